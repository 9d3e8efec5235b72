//! Locking helpers shared by every thread of the VMM.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, surviving a panic in another thread: device and VM state stays usable, and a
/// VMM that stops on every poisoned lock would take the guest down with one bad request.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
