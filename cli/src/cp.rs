//! `dsec cp [-r] SRC DST`: files, and with `-r` directory trees, between this host and a
//! sandbox (one side `ID:/absolute/path`), streamed in chunks through the Files API so memory
//! stays bounded whatever the sizes.
//!
//! Symlinks are copied as symlinks and never followed inside a copied tree, on either side:
//! on the host every entry is created relative to an open directory descriptor with
//! `O_NOFOLLOW`, so a symlink the sandbox put in the tree (or one that already sits in the
//! destination) cannot make `dsec cp` write outside the destination directory. The source
//! named on the command line is followed without `-r` (its content is copied) and copied as
//! a symlink with `-r`, as cp(1) does. Copies get the source's permission bits (setuid,
//! setgid and sticky are dropped on the host); in the sandbox symlinks and exact modes are
//! set by one `sh` script run after the data (`ln -s`, `chmod`), so the image needs `sh`,
//! `ln` and `chmod` (busybox and debian have them).

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use dsec_sdk::{Client, ExecStart, FileType};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use serde_json::json;

use crate::node::NodeError;

/// What a copy moved.
#[derive(Debug, Default)]
struct Stats {
    bytes: u64,
    files: u64,
    dirs: u64,
    symlinks: u64,
    skipped: u64,
}

/// `ID:/path` -> (ID, /path).
fn remote(s: &str) -> Option<(String, String)> {
    s.split_once(':')
        .filter(|(id, p)| id.starts_with("sb-") && p.starts_with('/'))
        .map(|(a, b)| (a.to_string(), b.to_string()))
}

fn usage(text: String) -> NodeError {
    NodeError::Usage(text)
}

fn io(what: String, source: std::io::Error) -> NodeError {
    NodeError::Io { what, source }
}

fn errno(what: String, e: Errno) -> NodeError {
    io(what, std::io::Error::from(e))
}

/// Joins a sandbox directory path and an entry name.
fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The last component of a sandbox path ("" for "/").
fn basename(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().unwrap_or("")
}

/// A name the sandbox listed must be one plain component: no separator, not `.` or `..`.
fn checked_name<'a>(name: &'a str, dir: &str) -> Result<&'a str, NodeError> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(usage(format!(
            "the sandbox listed a bad entry name {name:?} in {dir}: refusing to copy it"
        )));
    }
    Ok(name)
}

pub async fn cp(
    c: &Client,
    src: &str,
    dst: &str,
    recursive: bool,
    json_out: bool,
) -> Result<(), NodeError> {
    let mut stats = Stats::default();
    match (remote(src), remote(dst)) {
        (Some((id, path)), None) => {
            download(c, &id, &path, Path::new(dst), recursive, &mut stats).await?
        }
        (None, Some((id, path))) => {
            upload(c, Path::new(src), &id, &path, recursive, &mut stats).await?
        }
        _ => {
            return Err(usage(
                "cp: exactly one side must be SANDBOX_ID:/absolute/path".into(),
            ))
        }
    }
    if json_out {
        println!(
            "{}",
            json!({
                "bytes": stats.bytes, "files": stats.files, "dirs": stats.dirs,
                "symlinks": stats.symlinks, "skipped": stats.skipped,
            })
        );
    } else if recursive {
        eprintln!(
            "{} bytes copied ({} files, {} directories, {} symlinks{})",
            stats.bytes,
            stats.files,
            stats.dirs,
            stats.symlinks,
            if stats.skipped > 0 {
                format!(", {} special files skipped", stats.skipped)
            } else {
                String::new()
            }
        );
    } else {
        eprintln!("{} bytes copied", stats.bytes);
    }
    Ok(())
}

// ------------------------------------------------------------------ sandbox -> host

fn open_dir(path: &Path) -> Result<OwnedFd, NodeError> {
    nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno(format!("open directory {}", path.display()), e))
}

async fn download(
    c: &Client,
    id: &str,
    path: &str,
    dst: &Path,
    recursive: bool,
    stats: &mut Stats,
) -> Result<(), NodeError> {
    let info = c.stat(id, path).await?;
    let kind = FileType::try_from(info.r#type).unwrap_or(FileType::Other);
    let follow = !recursive && kind == FileType::Symlink;
    if kind == FileType::Dir && !recursive {
        return Err(usage(format!(
            "cp: {id}:{path} is a directory: use -r to copy it"
        )));
    }
    // cp(1): an existing destination directory receives the source under its own name.
    let into_dir = dst.is_dir();
    let name = basename(path);
    if kind == FileType::Dir && into_dir && matches!(name, "" | "." | "..") {
        // `ID:/`, `ID:/dir/.` into an existing directory: the entries go straight in.
        let fd = open_dir(dst)?;
        stats.dirs += 1;
        return fill_host_dir(c, id, path, &fd, dst, stats).await;
    }
    let (parent, leaf) = if into_dir {
        (dst.to_path_buf(), name.to_string())
    } else {
        let leaf = dst
            .file_name()
            .ok_or_else(|| usage(format!("cp: bad destination {}", dst.display())))?;
        let parent = dst
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let leaf = leaf.to_str().ok_or_else(|| {
            usage(format!(
                "cp: destination {} is not valid UTF-8",
                dst.display()
            ))
        })?;
        (parent.to_path_buf(), leaf.to_string())
    };
    let parent_fd = open_dir(&parent)?;
    let host = parent.join(&leaf);
    match kind {
        FileType::Dir => {
            download_dir(c, id, path, &parent_fd, &leaf, &host, info.mode, stats).await
        }
        FileType::Symlink if !follow => {
            make_symlink(&parent_fd, &leaf, &info.symlink_target, &host)?;
            stats.symlinks += 1;
            Ok(())
        }
        FileType::File | FileType::Symlink => {
            // A followed symlink's own mode says nothing: keep the default then.
            let mode = (!follow).then_some(info.mode);
            let file = if into_dir {
                create_at(&parent_fd, &leaf, &host)?
            } else {
                // The destination named on the command line is followed, as cp(1) does.
                nix::fcntl::open(
                    dst,
                    OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o666),
                )
                .map_err(|e| errno(format!("create {}", dst.display()), e))?
            };
            download_file(c, id, path, file, &host, mode, stats).await
        }
        _ => Err(usage(format!(
            "cp: {id}:{path} is not a regular file, directory or symlink"
        ))),
    }
}

/// Creates (or reuses) directory `name` under `parent` without following a symlink there,
/// and copies the sandbox directory `path` into it.
#[allow(clippy::too_many_arguments)]
async fn download_dir(
    c: &Client,
    id: &str,
    path: &str,
    parent: &OwnedFd,
    name: &str,
    host: &Path,
    mode: u32,
    stats: &mut Stats,
) -> Result<(), NodeError> {
    match nix::sys::stat::mkdirat(parent.as_fd(), name, Mode::from_bits_truncate(0o700)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(errno(format!("mkdir {}", host.display()), e)),
    }
    let fd = nix::fcntl::openat(
        parent.as_fd(),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        errno(
            format!(
                "refusing to copy into {}: it exists and is a symlink or not a directory",
                host.display()
            ),
            e,
        )
    })?;
    stats.dirs += 1;
    Box::pin(fill_host_dir(c, id, path, &fd, host, stats)).await?;
    nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode & 0o777))
        .map_err(|e| errno(format!("chmod {}", host.display()), e))
}

/// Copies the entries of sandbox directory `path` into the open host directory `dir`.
async fn fill_host_dir(
    c: &Client,
    id: &str,
    path: &str,
    dir: &OwnedFd,
    host: &Path,
    stats: &mut Stats,
) -> Result<(), NodeError> {
    for entry in c.list_dir(id, path).await? {
        let name = checked_name(&entry.name, path)?;
        let child = join(path, name);
        let child_host = host.join(name);
        match FileType::try_from(entry.r#type).unwrap_or(FileType::Other) {
            FileType::Dir => {
                download_dir(c, id, &child, dir, name, &child_host, entry.mode, stats).await?
            }
            FileType::File => {
                let file = create_at(dir, name, &child_host)?;
                download_file(c, id, &child, file, &child_host, Some(entry.mode), stats).await?
            }
            FileType::Symlink => {
                make_symlink(dir, name, &entry.symlink_target, &child_host)?;
                stats.symlinks += 1;
            }
            _ => {
                eprintln!("dsec: skipping {id}:{child}: not a regular file, directory or symlink");
                stats.skipped += 1;
            }
        }
    }
    Ok(())
}

/// A symlink `name` -> `target` in `dir` (never followed; an existing entry is an error,
/// except a symlink that already says the same).
fn make_symlink(dir: &OwnedFd, name: &str, target: &str, host: &Path) -> Result<(), NodeError> {
    match nix::unistd::symlinkat(target, dir.as_fd(), name) {
        Ok(()) => Ok(()),
        Err(Errno::EEXIST)
            if nix::fcntl::readlinkat(dir.as_fd(), name)
                .is_ok_and(|t| t.as_bytes() == target.as_bytes()) =>
        {
            Ok(())
        }
        Err(e) => Err(errno(format!("symlink {}", host.display()), e)),
    }
}

/// Creates or truncates `name` under `dir`, never through a symlink.
fn create_at(dir: &OwnedFd, name: &str, host: &Path) -> Result<OwnedFd, NodeError> {
    nix::fcntl::openat(
        dir.as_fd(),
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o666),
    )
    .map_err(|e| {
        let what = if e == Errno::ELOOP {
            format!(
                "refusing to write {}: it is a symlink (never followed)",
                host.display()
            )
        } else {
            format!("create {}", host.display())
        };
        errno(what, e)
    })
}

/// Streams sandbox file `path` into the open host file `fd`; `mode` sets its permission bits.
async fn download_file(
    c: &Client,
    id: &str,
    path: &str,
    fd: OwnedFd,
    host: &Path,
    mode: Option<u32>,
    stats: &mut Stats,
) -> Result<(), NodeError> {
    if let Some(mode) = mode {
        nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode & 0o777))
            .map_err(|e| errno(format!("chmod {}", host.display()), e))?;
    }
    let mut file = tokio::fs::File::from_std(std::fs::File::from(fd));
    stats.bytes += c.read_file_to(id, path, &mut file).await?;
    stats.files += 1;
    Ok(())
}

// ------------------------------------------------------------------ host -> sandbox

/// Work left for the sandbox-side script once the data is in.
enum Fixup {
    Symlink { target: String, path: String },
    Mode { mode: u32, path: String },
}

fn utf8(path: &Path) -> Result<&str, NodeError> {
    path.to_str().ok_or_else(|| {
        usage(format!(
            "cp: {} is not valid UTF-8, which sandbox paths must be",
            path.display()
        ))
    })
}

async fn upload(
    c: &Client,
    src: &Path,
    id: &str,
    path: &str,
    recursive: bool,
    stats: &mut Stats,
) -> Result<(), NodeError> {
    // cp(1): the named source is followed without -r, copied as a symlink with it.
    let meta = if recursive {
        std::fs::symlink_metadata(src)
    } else {
        std::fs::metadata(src)
    }
    .map_err(|e| io(format!("stat {}", src.display()), e))?;
    if meta.is_dir() && !recursive {
        return Err(usage(format!(
            "cp: {} is a directory: use -r to copy it",
            src.display()
        )));
    }
    let into_dir =
        matches!(c.stat(id, path).await, Ok(info) if info.r#type == FileType::Dir as i32);
    let target = if into_dir {
        // `.` or `..` have no name of their own: take the directory's.
        let name = src
            .file_name()
            .map(|n| n.to_os_string())
            .or_else(|| {
                src.canonicalize()
                    .ok()
                    .and_then(|p| p.file_name().map(|n| n.to_os_string()))
            })
            .ok_or_else(|| usage(format!("cp: bad source {}", src.display())))?;
        join(path, utf8(Path::new(&name))?)
    } else {
        path.to_string()
    };
    let mut fixups = Vec::new();
    let kind = meta.file_type();
    if kind.is_dir() {
        Box::pin(upload_dir(
            c,
            src,
            id,
            &target,
            meta.mode(),
            stats,
            &mut fixups,
        ))
        .await?;
    } else if kind.is_symlink() {
        let link =
            std::fs::read_link(src).map_err(|e| io(format!("readlink {}", src.display()), e))?;
        fixups.push(Fixup::Symlink {
            target: utf8(&link)?.to_string(),
            path: target,
        });
        stats.symlinks += 1;
    } else if kind.is_file() {
        upload_file(c, src, id, &target, meta.mode(), stats, &mut fixups).await?;
    } else {
        return Err(usage(format!(
            "cp: {} is not a regular file, directory or symlink",
            src.display()
        )));
    }
    run_fixups(c, id, fixups).await
}

async fn upload_file(
    c: &Client,
    src: &Path,
    id: &str,
    path: &str,
    mode: u32,
    stats: &mut Stats,
    fixups: &mut Vec<Fixup>,
) -> Result<(), NodeError> {
    // O_NOFOLLOW: an entry swapped for a symlink since it was listed is not followed.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(src)
        .map_err(|e| io(format!("open {}", src.display()), e))?;
    let mode = mode & 0o7777;
    stats.bytes += c
        .write_file_from(id, path, mode, tokio::fs::File::from_std(file))
        .await?;
    stats.files += 1;
    fixups.push(Fixup::Mode {
        mode,
        path: path.to_string(),
    });
    Ok(())
}

async fn upload_dir(
    c: &Client,
    src: &Path,
    id: &str,
    path: &str,
    mode: u32,
    stats: &mut Stats,
    fixups: &mut Vec<Fixup>,
) -> Result<(), NodeError> {
    match c.mkdir(id, path, false, 0o700).await {
        Ok(()) => {}
        Err(e) if e.code() == Some(tonic::Code::AlreadyExists) => {}
        Err(e) => return Err(e.into()),
    }
    stats.dirs += 1;
    let mut entries: Vec<_> = std::fs::read_dir(src)
        .map_err(|e| io(format!("list {}", src.display()), e))?
        .collect::<Result<_, _>>()
        .map_err(|e| io(format!("list {}", src.display()), e))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let local = entry.path();
        let name = entry.file_name();
        let child = join(path, utf8(Path::new(&name))?);
        // Not followed: a symlink is reported as one.
        let meta = std::fs::symlink_metadata(&local)
            .map_err(|e| io(format!("stat {}", local.display()), e))?;
        let kind = meta.file_type();
        if kind.is_dir() {
            Box::pin(upload_dir(
                c,
                &local,
                id,
                &child,
                meta.mode(),
                stats,
                fixups,
            ))
            .await?;
        } else if kind.is_file() {
            upload_file(c, &local, id, &child, meta.mode(), stats, fixups).await?;
        } else if kind.is_symlink() {
            let link = std::fs::read_link(&local)
                .map_err(|e| io(format!("readlink {}", local.display()), e))?;
            fixups.push(Fixup::Symlink {
                target: utf8(&link)?.to_string(),
                path: child,
            });
            stats.symlinks += 1;
        } else {
            eprintln!(
                "dsec: skipping {}: not a regular file, directory or symlink",
                local.display()
            );
            stats.skipped += 1;
        }
    }
    // After its entries: a read-only directory's mode does not get in the way.
    fixups.push(Fixup::Mode {
        mode: mode & 0o7777,
        path: path.to_string(),
    });
    Ok(())
}

/// Symlinks and exact modes in the sandbox: `l TARGET PATH` (an existing symlink at PATH is
/// replaced, anything else there is an error) and `m MODE PATH`, in order.
const FIXUP_SCRIPT: &str = r#"while [ $# -gt 0 ]; do
  case $1 in
    l) { if [ -L "$3" ]; then rm -f -- "$3"; fi; ln -s -- "$2" "$3"; } ;;
    m) chmod "$2" "$3" ;;
  esac || exit 1
  shift 3
done"#;

/// Argument bytes per script run (Linux allows 2 MiB of arguments and environment).
const FIXUP_BATCH_BYTES: usize = 256 << 10;

async fn run_fixups(c: &Client, id: &str, fixups: Vec<Fixup>) -> Result<(), NodeError> {
    // Symlinks first: they are leaves, and the directory modes come last of all.
    let (links, modes): (Vec<_>, Vec<_>) = fixups
        .into_iter()
        .partition(|f| matches!(f, Fixup::Symlink { .. }));
    let mut batch: Vec<String> = Vec::new();
    let mut size = 0;
    for fixup in links.into_iter().chain(modes) {
        let op = match fixup {
            Fixup::Symlink { target, path } => ["l".to_string(), target, path],
            Fixup::Mode { mode, path } => ["m".to_string(), format!("{mode:o}"), path],
        };
        size += op.iter().map(|s| s.len() + 1).sum::<usize>();
        batch.extend(op);
        if size >= FIXUP_BATCH_BYTES {
            run_fixup_batch(c, id, std::mem::take(&mut batch)).await?;
            size = 0;
        }
    }
    if !batch.is_empty() {
        run_fixup_batch(c, id, batch).await?;
    }
    Ok(())
}

async fn run_fixup_batch(c: &Client, id: &str, ops: Vec<String>) -> Result<(), NodeError> {
    let mut argv = vec!["sh".into(), "-c".into(), FIXUP_SCRIPT.into(), "sh".into()];
    argv.extend(ops);
    let start = ExecStart {
        sandbox_id: id.into(),
        argv,
        ..Default::default()
    };
    let out = c
        .exec_streaming(start, None::<tokio::io::Empty>, 4096, |_, _| {})
        .await?;
    if out.exit_code() != 0 {
        return Err(usage(format!(
            "cp: setting symlinks and modes in {id} failed (the image needs sh, ln and chmod): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}
