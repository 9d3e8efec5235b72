//! The layerfs benchmark image. Preferred: the cached Debian debootstrap image
//! (`debian.rs`), used in place. Fallback: a root filesystem tree staged from this host's
//! own files: hard links to /usr/bin, /usr/sbin, /usr/lib/x86_64-linux-gnu,
//! /usr/lib/python3* ... (so staging takes seconds and no disk), a copy of /etc, the
//! merged-/usr symlinks; whatever this host has installed, cut to a byte budget, but always
//! with what the benchmark's first command needs.

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::debian::DebianImage;

/// The host interpreter the first command runs (a path inside the staged tree too).
pub const PYTHON: &str = "/usr/bin/python3";
/// The imports of the first command run inside a host-staged image: Python and a few C
/// extensions (the host need not have numpy).
const FIRST_IMPORTS: &str = "import json, os, sqlite3, ssl";
/// What the first command prints.
const FIRST_CMD_OUTPUT: &str = "2";

/// The first command's `-c` program for these imports.
pub fn first_cmd(imports: &str) -> String {
    format!("{imports}; print(1+1)")
}

/// Directories hard-linked into the image, in this order, until the budget is used up.
const FILL_DIRS: &[&str] = &[
    "/usr/bin",
    "/usr/sbin",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/python3",
    "/usr/lib64",
    "/usr/share",
];

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot find what the first command needs: {0}; the layerfs benchmark needs the host's \
         {PYTHON} (Debian: apt-get install python3)"
    )]
    Python(String),
    #[error(
        "the staged tree at {root} cannot run the first command (chroot ROOT {PYTHON} -c ...): \
         {detail}; rerun with --keep-workdir and inspect the tree, or raise --image-mib"
    )]
    FirstCommand { root: PathBuf, detail: String },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StageError + 'a {
    move |source| StageError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// What was staged.
#[derive(Debug, Clone, Default)]
pub struct Staged {
    pub root: PathBuf,
    /// The Debian image used in place, or `None` for a tree staged from the host's files.
    pub debian: Option<DebianImage>,
    /// The first command's imports (`first_cmd`).
    pub first_imports: &'static str,
    /// Regular files (distinct inodes) and their bytes.
    pub files: u64,
    pub bytes: u64,
    /// Files copied instead of hard-linked (another filesystem, e.g. /etc bind mounts).
    pub copied: u64,
    /// The Python standard library's path inside the image, e.g. `usr/lib/python3.11`.
    pub python_stdlib: String,
    /// Source directories in order, each with whether it went in whole (`/etc` is copied,
    /// the others are hard-linked).
    pub sources: Vec<Source>,
}

/// One source directory of the image.
#[derive(Debug, Clone)]
pub struct Source {
    pub dir: String,
    /// Everything under it went in.
    pub whole: bool,
    /// Regular files it added (a file already added from elsewhere is not counted).
    pub files: u64,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.whole, self.files) {
            (true, _) => write!(f, "{}", self.dir),
            (false, 0) => write!(f, "{} (only its directories and symlinks)", self.dir),
            (false, n) => write!(f, "{} (in part: {n} files)", self.dir),
        }
    }
}

/// Paths of the files mapped into a process, from the text of `/proc/PID/maps` (only
/// absolute paths: not `[heap]`, anonymous maps or `(deleted)` files).
pub fn mapped_files(maps: &str) -> BTreeSet<String> {
    maps.lines()
        .filter_map(|l| {
            // address perms offset dev inode path (the path may contain spaces).
            let mut rest = l;
            for _ in 0..5 {
                rest = rest.trim_start().split_once(' ')?.1;
            }
            let path = rest.trim();
            (path.starts_with('/') && !path.ends_with(" (deleted)")).then(|| path.to_string())
        })
        .collect()
}

/// What the first command needs from the host: the files its process maps (interpreter,
/// shared libraries, extension modules) and the standard library directory.
fn first_command_needs() -> Result<(BTreeSet<String>, String), StageError> {
    let probe = format!(
        "{FIRST_IMPORTS}\nimport sysconfig, sys\n\
         sys.stdout.write('STDLIB ' + sysconfig.get_paths()['stdlib'] + '\\n')\n\
         sys.stdout.write(open('/proc/self/maps').read())"
    );
    let out = Command::new(PYTHON)
        .args(["-c", &probe])
        .output()
        .map_err(|e| StageError::Python(format!("cannot run {PYTHON}: {e}")))?;
    if !out.status.success() {
        return Err(StageError::Python(format!(
            "{PYTHON} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let stdlib = text
        .lines()
        .find_map(|l| l.strip_prefix("STDLIB "))
        .map(str::to_string)
        .ok_or_else(|| StageError::Python("no stdlib path printed".into()))?;
    if !stdlib.starts_with("/usr/") {
        return Err(StageError::Python(format!(
            "its standard library {stdlib} is not under /usr"
        )));
    }
    Ok((mapped_files(&text), stdlib))
}

struct Stager {
    root: PathBuf,
    budget: u64,
    /// Set at the first file over the budget: nothing more is added after it, so the
    /// image is a prefix of the source order, not one topped up with small files.
    full: bool,
    seen: HashSet<(u64, u64)>,
    staged: Staged,
}

impl Stager {
    fn dest(&self, host: &Path) -> PathBuf {
        self.root
            .join(host.strip_prefix("/").expect("host paths are absolute"))
    }

    /// Creates the directories from the root down to `host` (modes and owners as on the host).
    fn ensure_dirs(&mut self, host: &Path) -> Result<(), StageError> {
        let mut acc = PathBuf::from("/");
        for c in host.components().skip(1) {
            acc.push(c);
            let d = self.dest(&acc);
            if fs::symlink_metadata(&d).is_ok() {
                continue;
            }
            let md = fs::metadata(&acc).map_err(io("reading", &acc))?;
            fs::DirBuilder::new()
                .mode(md.mode() & 0o7777)
                .create(&d)
                .map_err(io("creating", &d))?;
            std::os::unix::fs::chown(&d, Some(md.uid()), Some(md.gid()))
                .map_err(io("chown", &d))?;
            fs::set_permissions(&d, fs::Permissions::from_mode(md.mode() & 0o7777))
                .map_err(io("chmod", &d))?;
        }
        Ok(())
    }

    /// Stages one non-directory; `force` ignores the budget. Returns whether it went in.
    fn entry(
        &mut self,
        host: &Path,
        md: &fs::Metadata,
        force: bool,
        copy: bool,
    ) -> Result<bool, StageError> {
        let d = self.dest(host);
        if fs::symlink_metadata(&d).is_ok() {
            return Ok(true);
        }
        if let Some(parent) = host.parent() {
            self.ensure_dirs(parent)?;
        }
        let ft = md.file_type();
        if ft.is_symlink() {
            let t = fs::read_link(host).map_err(io("reading link", host))?;
            std::os::unix::fs::symlink(&t, &d).map_err(io("creating symlink", &d))?;
            return Ok(true);
        }
        if !ft.is_file() {
            return Ok(true); // sockets, fifos, devices: not image content here
        }
        let new_inode = !self.seen.contains(&(md.dev(), md.ino()));
        if new_inode && !force && (self.full || self.staged.bytes + md.len() > self.budget) {
            self.full = true;
            return Ok(false);
        }
        self.seen.insert((md.dev(), md.ino()));
        let linked = !copy && fs::hard_link(host, &d).is_ok();
        if !linked {
            // Another filesystem (or /etc, which the host may change under us): a copy.
            fs::copy(host, &d).map_err(io("copying", host))?;
            std::os::unix::fs::chown(&d, Some(md.uid()), Some(md.gid()))
                .map_err(io("chown", &d))?;
            fs::set_permissions(&d, fs::Permissions::from_mode(md.mode() & 0o7777))
                .map_err(io("chmod", &d))?;
            self.staged.copied += 1;
        }
        if new_inode {
            self.staged.files += 1;
            self.staged.bytes += md.len();
        }
        Ok(true)
    }

    /// `tree`, recorded as a source of the image.
    fn source(&mut self, host: &Path, force: bool, copy: bool) -> Result<(), StageError> {
        let before = self.staged.files;
        let whole = self.tree(host, force, copy)?;
        self.staged.sources.push(Source {
            dir: host.display().to_string(),
            whole,
            files: self.staged.files - before,
        });
        Ok(())
    }

    /// Stages the tree under `host` in name order; returns whether all of it went in.
    fn tree(&mut self, host: &Path, force: bool, copy: bool) -> Result<bool, StageError> {
        let md = match fs::symlink_metadata(host) {
            Ok(md) => md,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
            Err(e) => return Err(io("reading", host)(e)),
        };
        if !md.is_dir() {
            return self.entry(host, &md, force, copy);
        }
        self.ensure_dirs(host)?;
        let mut names: Vec<_> = fs::read_dir(host)
            .map_err(io("listing", host))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(io("listing", host))?;
        names.sort();
        let mut whole = true;
        for n in names {
            whole &= self.tree(&host.join(n), force, copy)?;
        }
        Ok(whole)
    }
}

/// Stages the image at `root` (which must not exist) with at most `budget` bytes of files
/// beyond what the first command needs, then checks the first command runs in it.
pub fn stage(root: &Path, budget: u64) -> Result<Staged, StageError> {
    let (needed, stdlib) = first_command_needs()?;
    fs::create_dir(root).map_err(io("creating (it must not exist yet)", root))?;
    let mut s = Stager {
        root: root.to_path_buf(),
        budget,
        full: false,
        seen: HashSet::new(),
        staged: Staged {
            root: root.to_path_buf(),
            first_imports: FIRST_IMPORTS,
            python_stdlib: stdlib.trim_start_matches('/').to_string(),
            ..Staged::default()
        },
    };
    // The merged-/usr symlinks (bin -> usr/bin ...), as the host has them.
    for top in ["bin", "sbin", "lib", "lib64", "lib32", "libx32"] {
        let host = Path::new("/").join(top);
        if let Ok(t) = fs::read_link(&host) {
            let d = root.join(top);
            std::os::unix::fs::symlink(&t, &d).map_err(io("creating symlink", &d))?;
        }
    }
    // What the first command needs, whatever the budget: mapped files, the interpreter
    // (and the symlink naming it), the standard library.
    for p in needed.iter().filter(|p| p.starts_with("/usr/")) {
        let md = fs::symlink_metadata(p).map_err(io("reading", Path::new(p)))?;
        s.entry(Path::new(p), &md, true, false)?;
    }
    let python = Path::new(PYTHON);
    let md = fs::symlink_metadata(python).map_err(io("reading", python))?;
    s.entry(python, &md, true, false)?;
    s.source(Path::new(&stdlib), true, false)?;
    s.source(Path::new("/etc"), true, true)?;
    for dir in FILL_DIRS {
        if Path::new(dir).is_dir() {
            s.source(Path::new(dir), false, false)?;
        }
    }
    for dir in fs::read_dir("/usr/lib")
        .map_err(io("listing", Path::new("/usr/lib")))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().unwrap_or_default().to_string_lossy();
            n.starts_with("python3.") && p.to_string_lossy() != stdlib
        })
    {
        s.source(&dir, false, false)?;
    }
    run_first_command(root, FIRST_IMPORTS).map_err(|detail| StageError::FirstCommand {
        root: root.to_path_buf(),
        detail,
    })?;
    Ok(s.staged)
}

/// The Debian image as the benchmark image, used in place (read only: the first command
/// writes no bytecode). Counts its files and checks the first command runs in it.
pub fn debian(img: DebianImage) -> Result<Staged, StageError> {
    let root = img.root.clone();
    let lib = root.join("usr/lib");
    let stdlib = fs::read_dir(&lib)
        .map_err(io("listing", &lib))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("python3.") && lib.join(n).join("os.py").is_file())
        .max()
        .ok_or_else(|| {
            StageError::Python(format!("no usr/lib/python3.N/os.py in {}", root.display()))
        })?;
    let mut seen = HashSet::new();
    let (mut files, mut bytes) = (0u64, 0u64);
    count_files(&root, &mut seen, &mut files, &mut bytes)?;
    run_first_command(&root, crate::debian::FIRST_IMPORTS).map_err(|detail| {
        StageError::FirstCommand {
            root: root.clone(),
            detail,
        }
    })?;
    Ok(Staged {
        root,
        debian: Some(img),
        first_imports: crate::debian::FIRST_IMPORTS,
        files,
        bytes,
        copied: 0,
        python_stdlib: format!("usr/lib/{stdlib}"),
        sources: Vec::new(),
    })
}

/// Regular files under `dir` (distinct inodes) and their bytes; symlinks are not followed.
fn count_files(
    dir: &Path,
    seen: &mut HashSet<(u64, u64)>,
    files: &mut u64,
    bytes: &mut u64,
) -> Result<(), StageError> {
    for e in fs::read_dir(dir).map_err(io("listing", dir))? {
        let e = e.map_err(io("listing", dir))?;
        let p = e.path();
        let md = fs::symlink_metadata(&p).map_err(io("reading", &p))?;
        if md.is_dir() {
            count_files(&p, seen, files, bytes)?;
        } else if md.is_file() && seen.insert((md.dev(), md.ino())) {
            *files += 1;
            *bytes += md.len();
        }
    }
    Ok(())
}

/// `chroot ROOT python3 -c "IMPORTS; print(1+1)"`; checks its output. No bytecode is
/// written (the tree may be a shared cached image, and the lazy view is read-only anyway).
pub fn run_first_command(root: &Path, imports: &str) -> Result<(), String> {
    let out = Command::new("chroot")
        .arg(root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .args([PYTHON, "-c", &first_cmd(imports)])
        .output()
        .map_err(|e| format!("cannot run chroot: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || stdout.trim() != FIRST_CMD_OUTPUT {
        return Err(format!(
            "{} (stdout {:?}, stderr {:?})",
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_files_takes_absolute_paths_only() {
        let maps = "\
55d0c000-55d0d000 r--p 00000000 fe:00 1234     /usr/bin/python3.11
7f00-7f01 r-xp 00001000 fe:00 99   /usr/lib/x86_64-linux-gnu/libssl.so.3
7f01-7f02 rw-p 00000000 00:00 0 
7f02-7f03 rw-p 00000000 00:00 0        [heap]
7f03-7f04 r--p 00000000 fe:00 5    /tmp/a file with spaces
7f04-7f05 r--p 00000000 fe:00 6    /tmp/gone (deleted)
7f05-7f06 r--p 00000000 fe:00 1234     /usr/bin/python3.11
";
        let got: Vec<String> = mapped_files(maps).into_iter().collect();
        assert_eq!(
            got,
            [
                "/tmp/a file with spaces",
                "/usr/bin/python3.11",
                "/usr/lib/x86_64-linux-gnu/libssl.so.3"
            ]
        );
        assert!(mapped_files("garbage\n").is_empty());
    }

    #[test]
    fn budget_cuts_at_the_first_file_over_it_and_counts_links_once() {
        let tmp = std::env::temp_dir().join(format!("dsec-perf-stage-{}", std::process::id()));
        let src = tmp.join("src");
        fs::create_dir_all(src.join("d")).unwrap();
        fs::write(src.join("a"), [0u8; 10]).unwrap();
        fs::hard_link(src.join("a"), src.join("a2")).unwrap();
        fs::write(src.join("b"), [0u8; 20]).unwrap();
        fs::write(src.join("c"), [0u8; 5]).unwrap();
        fs::write(src.join("d/e"), [0u8; 1]).unwrap();
        std::os::unix::fs::symlink("a", src.join("l")).unwrap();
        let root = tmp.join("root");
        fs::create_dir(&root).unwrap();
        let mut s = Stager {
            root: root.clone(),
            budget: 25,
            full: false,
            seen: HashSet::new(),
            staged: Staged::default(),
        };
        assert!(!s.tree(&src, false, false).unwrap());
        // a (and its hard link a2) fit; b does not, so neither c nor d/e are added although
        // they would fit; symlinks and directories always are.
        let staged = root.join(src.strip_prefix("/").unwrap());
        assert_eq!((s.staged.files, s.staged.bytes), (1, 10));
        assert!(staged.join("a2").is_file() && staged.join("d").is_dir());
        assert!(!staged.join("b").exists() && !staged.join("c").exists());
        assert!(!staged.join("d/e").exists());
        assert_eq!(fs::read_link(staged.join("l")).unwrap(), Path::new("a"));
        // Forced entries ignore the budget.
        let md = fs::symlink_metadata(src.join("c")).unwrap();
        assert!(s.entry(&src.join("c"), &md, true, false).unwrap());
        assert_eq!(s.staged.bytes, 15);
        let src_str = src.display().to_string();
        let part = |files| Source {
            dir: src_str.clone(),
            whole: false,
            files,
        };
        assert_eq!(
            part(0).to_string(),
            format!("{src_str} (only its directories and symlinks)")
        );
        assert_eq!(part(3).to_string(), format!("{src_str} (in part: 3 files)"));
        fs::remove_dir_all(&tmp).unwrap();
    }
}
