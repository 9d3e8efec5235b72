//! A template-created microVM sandbox's memory base, in its directory: a hard link to the
//! template snapshot's `memory` (the same inode: no copy, and the page cache every restore of
//! the template shares) and a copy of its small `state` (which names the memory layout). Its VMM maps that memory MAP_PRIVATE, so a pause
//! writes only the pages the guest changed (a snapshot over the base) and the paused
//! snapshot carries links to the base in `base/`, its recorded parent. The links keep the
//! base alive when the template is rebuilt (a changed image, kernel or VMM) or removed.
//!
//! Jailed VMMs all run as one unprivileged uid and a paused snapshot sits in a directory that
//! a VMM can write, so the base's files must not be writable by that uid: a template's files
//! are sealed (root-owned, read-only) when it is built, and a base that is not sealed is not
//! used (the pause writes a full snapshot instead).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use dsec_vmm_api::{SNAPSHOT_MEMORY_FILE, SNAPSHOT_STATE_FILE};

/// The base's directory inside the sandbox's directory.
pub(super) const MEMORY_BASE_DIR: &str = "memory-base";
/// The base's directory inside a paused snapshot, as the snapshot's state names it.
pub(super) use crate::backend::microvm::SNAPSHOT_BASE_DIR as PAUSED_BASE_DIR;

const FILES: [&str; 2] = [SNAPSHOT_STATE_FILE, SNAPSHOT_MEMORY_FILE];

/// Makes a template snapshot's files root-owned and read-only, so that no jailed VMM can
/// change what every sandbox created from it maps.
pub(super) fn seal(snapshot: &Path) -> std::io::Result<()> {
    FILES
        .iter()
        .try_for_each(|name| seal_file(&snapshot.join(name)))
}

fn seal_file(path: &Path) -> std::io::Result<()> {
    std::os::unix::fs::chown(path, Some(0), Some(0))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444))
}

/// Makes `sandbox_dir`'s memory base from the template snapshot (atomically: a half-made
/// base is never seen). The state is copied, so that a template state rewritten in place
/// does not take the paused sandboxes' bases with it.
pub(super) fn keep(template_snapshot: &Path, sandbox_dir: &Path) -> std::io::Result<()> {
    let tmp = sandbox_dir.join(format!(".{MEMORY_BASE_DIR}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp)?;
    let linked = FILES.iter().try_for_each(|name| {
        let from = template_snapshot.join(name);
        sealed(&from)?;
        if *name == SNAPSHOT_STATE_FILE {
            std::fs::copy(&from, tmp.join(name))?;
            seal_file(&tmp.join(name))
        } else {
            std::fs::hard_link(&from, tmp.join(name))
        }
    });
    match linked.and_then(|()| std::fs::rename(&tmp, sandbox_dir.join(MEMORY_BASE_DIR))) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

/// The sandbox's memory base, if it has one and its files are sealed.
pub(super) fn of(sandbox_dir: &Path) -> Option<PathBuf> {
    let base = sandbox_dir.join(MEMORY_BASE_DIR);
    if !base.exists() {
        return None;
    }
    match FILES.iter().try_for_each(|name| sealed(&base.join(name))) {
        Ok(()) => Some(base),
        Err(err) => {
            tracing::warn!(base = %base.display(), %err, "the sandbox's memory base is not usable; its pauses write full snapshots");
            None
        }
    }
}

/// Links `base`'s files into `snapshot`/base (root-owned, as the base's own files are), and
/// makes that durable before the pause is recorded.
pub(super) fn link_into(base: &Path, snapshot: &Path) -> std::io::Result<()> {
    let into = snapshot.join(PAUSED_BASE_DIR);
    std::fs::create_dir(&into)?;
    for name in FILES {
        std::fs::hard_link(base.join(name), into.join(name))?;
    }
    std::fs::File::open(&into)?.sync_all()?;
    std::fs::File::open(snapshot)?.sync_all()
}

/// A regular file (not a link to elsewhere), root-owned and writable by nobody else.
fn sealed(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_file() || meta.uid() != 0 || meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a root-owned file that only root may write",
                path.display()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(dir: &Path) -> PathBuf {
        let snapshot = dir.join("template");
        std::fs::create_dir(&snapshot).unwrap();
        for name in FILES {
            std::fs::write(snapshot.join(name), name).unwrap();
            // Written by a jailed VMM.
            std::os::unix::fs::chown(snapshot.join(name), Some(65534), Some(65534)).unwrap();
        }
        snapshot
    }

    #[test]
    fn a_sealed_template_becomes_the_base_and_is_linked_into_a_pause() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: sealing needs root (chown)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let snapshot = template(dir.path());
        let sandbox = dir.path().join("sandbox");
        std::fs::create_dir(&sandbox).unwrap();
        assert!(keep(&snapshot, &sandbox).is_err(), "an unsealed template");
        assert!(of(&sandbox).is_none());
        seal(&snapshot).unwrap();
        keep(&snapshot, &sandbox).unwrap();
        let base = of(&sandbox).expect("the sealed base");
        // The template's state rewritten in place, then the template rebuilt: the base
        // keeps its files.
        std::fs::write(snapshot.join(SNAPSHOT_STATE_FILE), "garbage").unwrap();
        std::fs::remove_dir_all(&snapshot).unwrap();
        let paused = dir.path().join("paused");
        std::fs::create_dir(&paused).unwrap();
        link_into(&base, &paused).unwrap();
        for name in FILES {
            let a = std::fs::metadata(base.join(name)).unwrap();
            let b = std::fs::metadata(paused.join(PAUSED_BASE_DIR).join(name)).unwrap();
            assert_eq!((a.ino(), a.uid(), a.mode() & 0o777), (b.ino(), 0, 0o444));
            assert_eq!(std::fs::read_to_string(base.join(name)).unwrap(), name);
        }
    }

    /// Whether a process of the jail uid can write `path` or change its mode.
    fn jail_uid_can_change(path: &Path) -> bool {
        use std::os::unix::process::CommandExt;
        let run = |script: &str| {
            std::process::Command::new("/bin/sh")
                .args(["-c", script, "sh"])
                .arg(path)
                .uid(65534)
                .gid(65534)
                .stderr(std::process::Stdio::null())
                .status()
                .unwrap()
                .success()
        };
        run(r#"printf evil 1<> "$1""#) || run(r#"chmod 666 "$1""#)
    }

    /// The attack sealing stops: a VMM taken over by its guest, in a directory it may write
    /// (where a pause links its base), writes the template's memory that every sandbox
    /// created from it maps.
    #[test]
    fn the_jail_uid_cannot_write_a_sealed_template_through_a_paused_link() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: sealing and the jail uid need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let snapshot = template(dir.path());
        let paused = dir.path().join("paused");
        std::fs::create_dir(&paused).unwrap();
        std::os::unix::fs::chown(&paused, Some(65534), Some(65534)).unwrap();
        link_into(&snapshot, &paused).unwrap();
        let linked = paused.join(PAUSED_BASE_DIR).join(SNAPSHOT_MEMORY_FILE);
        // Unsealed, as the template's VMM wrote it: the attack works.
        assert!(
            jail_uid_can_change(&linked),
            "the unsealed template is writable"
        );
        std::fs::write(snapshot.join(SNAPSHOT_MEMORY_FILE), SNAPSHOT_MEMORY_FILE).unwrap();
        seal(&snapshot).unwrap();
        for name in FILES {
            let linked = paused.join(PAUSED_BASE_DIR).join(name);
            assert!(!jail_uid_can_change(&linked), "{name} is sealed");
            assert_eq!(std::fs::read_to_string(snapshot.join(name)).unwrap(), name);
        }
    }

    #[test]
    fn a_base_someone_else_may_write_is_not_used() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: sealing needs root (chown)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let snapshot = template(dir.path());
        seal(&snapshot).unwrap();
        let sandbox = dir.path().join("sandbox");
        std::fs::create_dir(&sandbox).unwrap();
        keep(&snapshot, &sandbox).unwrap();
        let memory = sandbox.join(MEMORY_BASE_DIR).join(SNAPSHOT_MEMORY_FILE);
        std::fs::set_permissions(&memory, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(of(&sandbox).is_none(), "a world-writable base");
        std::fs::set_permissions(&memory, std::fs::Permissions::from_mode(0o444)).unwrap();
        std::os::unix::fs::chown(&memory, Some(65534), None).unwrap();
        assert!(of(&sandbox).is_none(), "a base owned by the jail uid");
        // A planted link to elsewhere.
        std::fs::remove_file(&memory).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &memory).unwrap();
        assert!(of(&sandbox).is_none(), "a symlink");
    }
}
