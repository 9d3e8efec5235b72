//! Pause that frees memory: a microVM sandbox's pause writes a snapshot to local disk and
//! ends its VMM (the record keeps the snapshot's path, so it survives a daemon restart);
//! resume restores it (MAP_PRIVATE over the snapshot's memory) in the same directory, so it keeps its id, vsock socket,
//! context id and disks, and everything in the guest (files, processes, sessions). A
//! template-created sandbox's pause writes only the pages that differ from its template
//! (`memory_base`), and its resume maps the template's memory again.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::cgroup;
use super::error::NodeError;
use super::memory_base;
use super::node::Node;
use super::record::{now_ms, Entry};
use super::vmm_control;
use crate::backend::microvm::resume_microvm;
use crate::backend::proc_stat;
use crate::backend::vmm_pool::Shape;

impl Node {
    /// Pauses the VM, snapshots it next to the sandbox and ends its VMM. A snapshot that
    /// cannot be written (a full disk) fails the pause and the VM keeps running.
    pub(super) async fn suspend(&self, entry: &Arc<Entry>) -> Result<(), NodeError> {
        let record = entry.record();
        vmm_control::pause(&record).await?;
        // A jailed VMM writes only its snapshot directory.
        let path = record
            .handle
            .snapshot_dir
            .clone()
            .unwrap_or_else(|| record.handle.dir.clone())
            .join(format!("paused-{}", now_ms()));
        let written = write_pause_snapshot(&record, &path).await;
        let persisted = written.and_then(|kind| {
            let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
            r.paused = true;
            r.suspended = Some(path.clone());
            r.persist().map(|()| kind).map_err(|e| {
                r.paused = false;
                r.suspended = None;
                NodeError::Internal(format!("cannot persist the paused sandbox's record: {e}"))
            })
        });
        match persisted {
            Ok(kind) => self.metrics.pauses[kind as usize].fetch_add(1, Ordering::Relaxed),
            Err(err) => {
                let _ = std::fs::remove_dir_all(&path);
                vmm_control::resume(&record).await?;
                return Err(err);
            }
        };
        let handle = record.handle.clone();
        tokio::task::spawn_blocking(move || handle.kill_process())
            .await
            .map_err(|e| NodeError::Internal(format!("VMM kill task failed: {e}")))??;
        // The snapshot was fsynced when the VMM committed it: its pages in the page cache are
        // clean copies of what is on disk (charged to the sandbox's cgroup), which the resume
        // reads back on demand. Drop them so that a paused sandbox holds no host memory.
        let memory = path.join(dsec_vmm_api::SNAPSHOT_MEMORY_FILE);
        let dropped = tokio::task::spawn_blocking(move || drop_page_cache(&memory)).await;
        if let Ok(Err(err)) = dropped {
            tracing::warn!(sandbox = %record.handle.id, %err, "the paused sandbox's snapshot stays in the page cache");
        }
        entry.event(&format!(
            "VMM ended after a snapshot to {} (pause frees its memory)",
            path.display()
        ));
        Ok(())
    }

    /// Restores a suspended sandbox and swaps in its new entry; its snapshot is removed once
    /// the guest answers (the new VMM's mapping keeps the memory file's pages reachable).
    pub(super) async fn wake(
        &self,
        entry: &Arc<Entry>,
        snapshot: PathBuf,
    ) -> Result<Arc<Entry>, NodeError> {
        let started = std::time::Instant::now();
        let mut record = entry.record();
        let shape = Shape {
            mem_mib: u64::try_from(record.memory_mib).unwrap_or(0),
            vcpus: u8::try_from(record.vcpus).unwrap_or(0),
        };
        let resumed = resume_microvm(
            &self.edge,
            &record.handle,
            &snapshot,
            cgroup::procs_files(&record.cgroups),
            shape,
            self.config.ready_timeout,
        )
        .await?;
        let (pid, client) = (resumed.pid, resumed.agent);
        record.handle.pid = pid as i32;
        record.handle.pid_start = proc_stat(pid as i32).map_or(0, |(_, start)| start);
        // A prewarmed VMM brings its own jail; the old one's directories go once the
        // snapshot in them does.
        let old_jail = resumed.pooled_jail.map(|(snapshots, root)| {
            let old = (
                record.handle.snapshot_dir.take(),
                record.handle.jail_root.take(),
            );
            record.handle.snapshot_dir = Some(snapshots);
            record.handle.jail_root = Some(root);
            old
        });
        record.paused = false;
        record.suspended = None;
        if let Err(err) = record.persist() {
            // The old record still names the snapshot: kill the new VMM and stay paused.
            let handle = record.handle.clone();
            let _ = tokio::task::spawn_blocking(move || handle.kill_process()).await;
            return Err(NodeError::Internal(format!(
                "cannot persist the resumed sandbox's record: {err}"
            )));
        }
        let id = record.handle.id.clone();
        tracing::info!(
            sandbox = %id,
            ms = started.elapsed().as_millis() as u64,
            "resumed from its snapshot on disk"
        );
        let woken = Entry::new(record, client);
        self.lock().insert(id, woken.clone());
        let _ = tokio::task::spawn_blocking(move || {
            let _ = std::fs::remove_dir_all(snapshot);
            if let Some((snapshots, root)) = old_jail {
                snapshots.map(std::fs::remove_dir);
                root.map(std::fs::remove_dir_all);
            }
        })
        .await;
        Ok(woken)
    }
}

/// What a pause wrote; the index of its counter in `Metrics::pauses`.
#[derive(Clone, Copy)]
enum PauseSnapshot {
    OverBase = 0,
    Full = 1,
}

/// The paused VM's snapshot in the new directory `path`: over the sandbox's memory base when
/// it has one (the base linked in as the snapshot's parent), else, or if that fails, full.
async fn write_pause_snapshot(
    record: &super::record::Record,
    path: &std::path::Path,
) -> Result<PauseSnapshot, NodeError> {
    let dir = record.handle.dir.clone();
    let base = tokio::task::spawn_blocking(move || memory_base::of(&dir))
        .await
        .unwrap_or(None);
    if let Some(base) = base {
        let over = vmm_control::snapshot_over_base(
            record,
            path.to_owned(),
            memory_base::PAUSED_BASE_DIR.into(),
        )
        .await;
        let linked = match over {
            Ok(_) => {
                let snapshot = path.to_owned();
                tokio::task::spawn_blocking(move || memory_base::link_into(&base, &snapshot))
                    .await
                    .map_err(|e| NodeError::Internal(format!("link task failed: {e}")))
                    .and_then(|r| {
                        r.map_err(|e| {
                            NodeError::Internal(format!(
                                "cannot link the memory base into {}: {e}",
                                path.display()
                            ))
                        })
                    })
            }
            Err(e) => Err(e),
        };
        match linked {
            Ok(()) => return Ok(PauseSnapshot::OverBase),
            Err(err) => {
                tracing::warn!(sandbox = %record.handle.id, %err, "a pause over the memory base failed; writing a full snapshot");
                let _ = std::fs::remove_dir_all(path);
            }
        }
    }
    vmm_control::snapshot(record, path.to_owned(), false)
        .await
        .map(|_| PauseSnapshot::Full)
}

/// Drops `path`'s clean pages from the page cache (best effort: dirty pages stay until they
/// are written back, and a RAM-backed file system keeps them, as they are its storage).
pub(crate) fn drop_page_cache(path: &std::path::Path) -> std::io::Result<()> {
    let file = std::fs::File::open(path)?;
    nix::fcntl::posix_fadvise(
        &file,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// Pages of `file` (of `len` bytes) in the page cache, by mincore(2) over a mapping.
    fn resident_pages(file: &std::fs::File, len: usize) -> usize {
        let page = 4096;
        // SAFETY: a fresh read-only shared mapping of our own file, unmapped below; mincore
        // writes one byte per page into a vector of that many bytes.
        unsafe {
            let addr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            assert_ne!(addr, libc::MAP_FAILED, "mmap the test file");
            let mut vec = vec![0u8; len.div_ceil(page)];
            assert_eq!(libc::mincore(addr, len, vec.as_mut_ptr()), 0, "mincore");
            libc::munmap(addr, len);
            vec.iter().filter(|b| *b & 1 == 1).count()
        }
    }

    #[test]
    fn a_paused_sandboxs_snapshot_leaves_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let len = 4 << 20;
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(&vec![0x5a; len]).unwrap();
        file.sync_all().unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let before = resident_pages(&file, len);
        if before == 0 {
            eprintln!("skipped: this file system keeps nothing in the page cache after a write");
            return;
        }
        super::drop_page_cache(&path).unwrap();
        let after = resident_pages(&file, len);
        let tmpfs = nix::sys::statfs::statfs(dir.path())
            .map(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
            .unwrap_or(false);
        if tmpfs {
            eprintln!("skipped: on tmpfs the page cache is the file's storage");
            return;
        }
        assert!(
            after < before / 8,
            "{after} of {} pages still cached after the drop ({before} before)",
            len / 4096
        );
    }

    #[test]
    fn dropping_a_missing_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(super::drop_page_cache(&dir.path().join("missing")).is_err());
    }
}
