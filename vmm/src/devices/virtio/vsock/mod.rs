//! virtio-vsock with a userspace backend: guest streams become Unix-socket streams on the
//! host (`CONNECT <port>\n` handshake for host-initiated ones, `<uds>_<port>` for
//! guest-initiated ones).

mod hostile;
mod muxer;
#[doc(hidden)]
pub use hostile::hostile_round;
pub mod packet;
mod persist;

use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::memory::GuestMemory;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use super::pause::{PauseError, PauseHandshake};
use super::{
    read_config_bytes, ActivateError, Interrupt, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
};
pub use muxer::MuxerLimits;
pub use persist::VsockState;

pub const VIRTIO_ID_VSOCK: u32 = 19;
const QUEUE_SIZE: u16 = 256;
const QUEUE_SIZES: [u16; 3] = [QUEUE_SIZE; 3];

pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: Option<std::os::unix::net::UnixListener>,
    common: VirtioCommon,
    stop: Option<EventFd>,
    /// The muxer thread's pause handshake, while it runs.
    pause: Option<Arc<PauseHandshake>>,
    reset_on_activate: bool,
    /// The next host connection's port, carried across snapshots: a restored guest can still
    /// hold the snapshot's connections (reset, but not yet closed by their owner), and a new
    /// connection from one of their ports would be refused.
    next_host_port: Arc<AtomicU32>,
    worker: Option<JoinHandle<()>>,
}

impl Vsock {
    /// Binds the host socket now, so that a bad path fails VM creation, not the first connect.
    pub fn new(guest_cid: u64, uds_path: PathBuf) -> std::io::Result<Self> {
        // A stale socket from a crashed VMM would make bind fail.
        if std::fs::symlink_metadata(&uds_path).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_socket()
        }) {
            std::fs::remove_file(&uds_path)?;
        }
        let listener = std::os::unix::net::UnixListener::bind(&uds_path).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("bind vsock socket {}: {e}", uds_path.display()),
            )
        })?;
        listener.set_nonblocking(true)?;
        Ok(Vsock {
            guest_cid,
            uds_path,
            listener: Some(listener),
            common: VirtioCommon::default(),
            stop: None,
            pause: None,
            reset_on_activate: false,
            next_host_port: Arc::new(AtomicU32::new(muxer::FIRST_HOST_PORT)),
            worker: None,
        })
    }

    fn stop_worker(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.write(1);
        }
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        self.pause = None;
    }
}

impl Drop for Vsock {
    // The socket file stays: the last reference may go on a vCPU thread, whose seccomp
    // filter has no unlink. The VMM's main thread removes it when the VM is over.
    fn drop(&mut self) {
        self.stop_worker();
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    crate::virtio_common_field!();

    fn thread_name(&self) -> &'static str {
        "vsock"
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        queue_events: Vec<EventFd>,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        let [rx, tx, event]: [Queue; 3] =
            queues.try_into().map_err(|_| ActivateError::BadQueues)?;
        let [rx_evt, tx_evt, event_evt]: [EventFd; 3] = queue_events
            .try_into()
            .map_err(|_| ActivateError::BadQueues)?;
        let pause = Arc::new(PauseHandshake::new("vsock")?);
        let listener = match &self.listener {
            Some(l) => l.try_clone()?,
            None => return Err(ActivateError::BadQueues),
        };
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        let mut muxer = muxer::Muxer::new(
            self.guest_cid,
            self.uds_path.clone(),
            listener,
            mem,
            [rx, tx, event],
            rx_evt,
            tx_evt,
            event_evt,
            stop.try_clone()?,
            pause.clone(),
            interrupt,
            MuxerLimits::default(),
        )?
        .with_host_ports(self.next_host_port.clone());
        if std::mem::take(&mut self.reset_on_activate) {
            muxer.announce_transport_reset();
        }
        let worker = std::thread::Builder::new()
            .name(self.thread_name().into())
            .spawn(move || {
                crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Device);
                muxer.run()
            })?;
        self.stop = Some(stop);
        self.pause = Some(pause);
        self.worker = Some(worker);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.stop_worker();
        true
    }

    fn prepare_restore(&mut self) {
        self.reset_on_activate = true;
    }

    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        self.worker.as_ref()?;
        self.pause.as_ref().map(|p| p.queue_states())
    }

    fn request_pause(&mut self) -> Result<(), PauseError> {
        // Not active: nothing touches guest memory.
        self.pause.as_ref().map_or(Ok(()), |p| p.request())
    }

    fn wait_paused(&mut self) -> Result<(), PauseError> {
        self.pause.as_ref().map_or(Ok(()), |p| p.wait_parked())
    }

    fn resume(&mut self) {
        if let Some(pause) = &self.pause {
            pause.resume();
        }
    }
}
