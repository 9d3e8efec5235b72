//! A device thread shared by the simple virtio devices (rng, block, net): one epoll loop over
//! the queue kick eventfds, optional host fds (a tap), a stop eventfd and the pause handshake
//! the snapshot code needs ([`super::pause`], shared with the vsock muxer).

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::pause::{PauseError, PauseHandshake};
use super::Interrupt;
use crate::memory::GuestMemory;

const TOKEN_STOP: u64 = u64::MAX;
const TOKEN_PAUSE: u64 = u64::MAX - 1;
/// Host fds get tokens from here (queues use their index).
const TOKEN_FD_BASE: u64 = 1 << 32;

/// What a device does when one of its queues is kicked or one of its host fds is ready.
pub trait QueueHandler: Send + 'static {
    /// Processes what the guest made available on queue `index`. Returns true when a used
    /// ring changed (the worker then interrupts the guest).
    fn queue_event(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> bool;
    /// Host fds to wait on, edge-triggered for input (e.g. a tap).
    fn host_fds(&self) -> Vec<RawFd> {
        Vec::new()
    }
    /// Host fd number `index` (in `host_fds` order) became readable.
    fn fd_event(&mut self, _index: usize, _queues: &mut [Queue], _mem: &GuestMemory) -> bool {
        false
    }
    /// How often `tick` runs (None: never). Read once when the thread starts.
    fn tick_interval(&self) -> Option<Duration> {
        None
    }
    /// Periodic work (e.g. asking the guest for fresh statistics).
    fn tick(&mut self, _queues: &mut [Queue], _mem: &GuestMemory) -> bool {
        false
    }
}

/// A running device thread.
pub struct Worker {
    stop: EventFd,
    pause: Arc<PauseHandshake>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    pub fn spawn<H: QueueHandler + ?Sized>(
        name: &'static str,
        mut handler: Box<H>,
        mem: GuestMemory,
        mut queues: Vec<Queue>,
        events: Vec<EventFd>,
        interrupt: Arc<Interrupt>,
    ) -> std::io::Result<Worker> {
        let epoll = Epoll::new()?;
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        let pause = Arc::new(PauseHandshake::new(name)?);
        let add = |fd: RawFd, token: u64, set: EventSet| {
            epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(set, token))
        };
        for (i, e) in events.iter().enumerate() {
            add(e.as_raw_fd(), i as u64, EventSet::IN)?;
        }
        for (i, fd) in handler.host_fds().into_iter().enumerate() {
            add(
                fd,
                TOKEN_FD_BASE + i as u64,
                EventSet::IN | EventSet::EDGE_TRIGGERED,
            )?;
        }
        add(stop.as_raw_fd(), TOKEN_STOP, EventSet::IN)?;
        add(pause.event_fd(), TOKEN_PAUSE, EventSet::IN)?;
        let (thread_stop, thread_pause) = (stop.try_clone()?, pause.clone());
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Device);
                // The guest may have queued buffers before we started listening for kicks.
                let mut used = false;
                for i in 0..queues.len() {
                    used |= handler.queue_event(i, &mut queues, &mem);
                }
                if used {
                    interrupt.signal_used_queue();
                }
                let mut ready = vec![EpollEvent::default(); 16];
                let interval = handler.tick_interval();
                let mut next_tick = interval.map(|i| Instant::now() + i);
                loop {
                    let timeout = next_tick.map_or(-1, |t| {
                        let ms = t.saturating_duration_since(Instant::now()).as_millis();
                        i32::try_from(ms).unwrap_or(i32::MAX)
                    });
                    let n = match epoll.wait(timeout, &mut ready) {
                        Ok(n) => n,
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => {
                            tracing::error!("virtio device epoll failed, device stops: {e}");
                            return;
                        }
                    };
                    let mut used = false;
                    if let (Some(t), Some(i)) = (next_tick, interval) {
                        if Instant::now() >= t {
                            used |= handler.tick(&mut queues, &mem);
                            next_tick = Some(Instant::now() + i);
                        }
                    }
                    for event in &ready[..n] {
                        match event.data() {
                            TOKEN_STOP => {
                                let _ = thread_stop.read();
                                return;
                            }
                            TOKEN_PAUSE => thread_pause.park(&queues),
                            t if t >= TOKEN_FD_BASE => {
                                let i = (t - TOKEN_FD_BASE) as usize;
                                used |= handler.fd_event(i, &mut queues, &mem);
                            }
                            t => {
                                let i = t as usize;
                                if let Some(e) = events.get(i) {
                                    let _ = e.read();
                                }
                                used |= handler.queue_event(i, &mut queues, &mem);
                            }
                        }
                    }
                    if used {
                        interrupt.signal_used_queue();
                    }
                }
            })?;
        Ok(Worker {
            stop,
            pause,
            thread: Some(thread),
        })
    }

    /// Asks the thread to park (it stops touching guest memory); see [`Worker::wait_paused`].
    pub fn request_pause(&self) -> Result<(), PauseError> {
        self.pause.request()
    }

    /// Waits until the thread asked to park has.
    pub fn wait_paused(&self) -> Result<(), PauseError> {
        self.pause.wait_parked()
    }

    pub fn resume(&self) {
        self.pause.resume();
    }

    /// Queue positions published by the parked thread.
    pub fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        self.pause.queue_states()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // A parked thread must wake up to see the stop.
        self.resume();
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Pops every available chain of `queue`, hands it to `f` (which returns the number of bytes
/// it wrote into the chain) and returns it to the guest. Returns true if any chain was used.
/// Stops after one ring's worth so a guest that keeps refilling cannot pin the thread.
pub fn drain_queue(
    queue: &mut Queue,
    mem: &GuestMemory,
    mut f: impl FnMut(virtio_queue::DescriptorChain<&GuestMemory>) -> u32,
) -> bool {
    let mut used = false;
    for _ in 0..queue.size().max(1) {
        let Some(chain) = queue.pop_descriptor_chain(mem) else {
            break;
        };
        let head = chain.head_index();
        let len = f(chain);
        if let Err(e) = queue.add_used(mem, head, len) {
            tracing::debug!("cannot return a descriptor to the guest: {e:?}");
            break;
        }
        used = true;
    }
    used
}
