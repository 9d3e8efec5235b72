//! CPU priority of the calling thread for background work (a prewarmed VMM building its shell
//! while sandboxes run). Linux keeps the nice value per thread, and threads inherit it from
//! the thread that starts them.

/// The nice value background work runs at: it yields to the running sandboxes' threads
/// (CFS weight 110 against 1024) without stopping while the host is busy.
pub const BACKGROUND_NICE: i32 = 10;

/// The calling thread at [`BACKGROUND_NICE`] until dropped, then at its earlier nice value
/// again (lowering the nice value back needs CAP_SYS_NICE, which the VMM has until it drops
/// its privileges). Best effort: a failure leaves the priority as it was.
pub struct Background {
    before: Option<i32>,
}

fn thread_nice() -> Option<i32> {
    // SAFETY: errno is this thread's; it is cleared first because -1 is also a valid
    // priority, and getpriority only reads the scheduler's value of the calling thread.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        (*libc::__errno_location() == 0).then_some(nice)
    }
}

fn set_thread_nice(nice: i32) -> bool {
    // SAFETY: setpriority on the calling thread (who = 0) with a plain integer.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) == 0 }
}

impl Background {
    pub fn enter() -> Background {
        let before = thread_nice().filter(|&nice| nice < BACKGROUND_NICE);
        match before {
            Some(_) if set_thread_nice(BACKGROUND_NICE) => Background { before },
            _ => Background { before: None },
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(nice) = self.before {
            if !set_thread_nice(nice) {
                tracing::warn!(
                    "cannot return to nice {nice}; the VM runs at nice {BACKGROUND_NICE}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn background_work_runs_niced_and_returns_to_the_earlier_priority() {
        // In its own thread: the value is per thread.
        std::thread::spawn(|| {
            let before = thread_nice().unwrap();
            let background = Background::enter();
            assert_eq!(thread_nice(), Some(BACKGROUND_NICE.max(before)));
            // A thread started now inherits it.
            let inherited = std::thread::spawn(thread_nice).join().unwrap();
            assert_eq!(inherited, Some(BACKGROUND_NICE.max(before)));
            drop(background);
            // Raising it back needs CAP_SYS_NICE (tests run as root here).
            assert_eq!(thread_nice(), Some(before));
        })
        .join()
        .unwrap();
    }
}
