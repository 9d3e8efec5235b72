//! The layerfs benchmark's real image: a Debian bookworm root filesystem built with
//! `debootstrap --variant=minbase` with Python and a large scientific stack (about 1 GiB),
//! cached outside the repository under `${DSEC_CACHE:-/var/cache/dsec}/perf/` keyed by a
//! hash of the suite, mirror and package list, and built again only when absent.

use std::fs;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_layerfs::Digest;

pub const SUITE: &str = "bookworm";
pub const MIRROR: &str = "http://deb.debian.org/debian";
const MIRROR_HOST: &str = "deb.debian.org:80";
/// Added to minbase (dependencies come along): Python with a large dependency set, a
/// compiler and git, as an agentic training sandbox would have.
pub const PACKAGES: &[&str] = &[
    "build-essential",
    "git",
    "python3",
    "python3-matplotlib",
    "python3-numpy",
    "python3-pandas",
    "python3-pip",
    "python3-scipy",
    "python3-sklearn",
    "python3-sympy",
];
/// The first command's imports in this image: the interpreter, C extensions and numpy
/// (which maps OpenBLAS and friends).
pub const FIRST_IMPORTS: &str = "import json, os, sqlite3, ssl, numpy";

#[derive(Debug, thiserror::Error)]
pub enum DebianError {
    #[error(
        "debootstrap is not installed (apt-get install debootstrap, or run ./setup.sh); \
         cannot build the Debian benchmark image"
    )]
    NoDebootstrap,
    #[error(
        "the Debian mirror {MIRROR} is unreachable ({0}); the image is built once and cached, \
         so run once where the mirror is reachable, or use --image host"
    )]
    MirrorUnreachable(String),
    #[error("debootstrap failed ({status}); its log is {log}")]
    Debootstrap { status: String, log: PathBuf },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> DebianError + 'a {
    move |source| DebianError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The exact debootstrap invocation the cache key covers.
pub fn key() -> String {
    format!(
        "debootstrap --variant=minbase {SUITE} {MIRROR} --include={}",
        PACKAGES.join(",")
    )
}

/// `${DSEC_CACHE:-/var/cache/dsec}/perf`.
pub fn cache_root() -> PathBuf {
    std::env::var_os("DSEC_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/dsec"))
        .join("perf")
}

/// Where the image for `key` lives under `root`: `debian-bookworm-<16 hex of sha256(key)>`.
pub fn image_dir(root: &Path, key: &str) -> PathBuf {
    let h = Digest::of(key.as_bytes()).hex();
    root.join(format!("debian-{SUITE}-{}", &h[..16]))
}

/// The cached image.
#[derive(Debug, Clone)]
pub struct DebianImage {
    pub root: PathBuf,
    pub key: String,
    /// Seconds the build took, when this run built it (`None`: it was cached).
    pub built_s: Option<f64>,
}

const DEBOOTSTRAP: &[&str] = &["/usr/sbin/debootstrap", "/usr/bin/debootstrap"];

/// The cached image, built first if absent (minutes: it downloads a few hundred MiB).
/// A failed build leaves nothing behind but its log.
pub fn ensure() -> Result<DebianImage, DebianError> {
    ensure_in(&cache_root(), DEBOOTSTRAP, MIRROR_HOST)
}

/// `ensure` with the cache root, where debootstrap may be and the mirror's host:port given.
fn ensure_in(
    cache: &Path,
    debootstrap: &[&str],
    mirror_host: &str,
) -> Result<DebianImage, DebianError> {
    let key = key();
    let dir = image_dir(cache, &key);
    if dir.join("usr/bin/python3").exists() {
        return Ok(DebianImage {
            root: dir,
            key,
            built_s: None,
        });
    }
    if !debootstrap.iter().any(|p| Path::new(p).exists()) {
        return Err(DebianError::NoDebootstrap);
    }
    mirror_reachable(mirror_host)?;
    fs::create_dir_all(cache).map_err(io("creating", cache))?;
    let name = dir.file_name().expect("a file name").to_string_lossy();
    let tmp = cache.join(format!("tmp-{name}-{}", std::process::id()));
    let log = cache.join(format!("{name}.log"));
    eprintln!(
        "dsec-perf: building the Debian benchmark image (once; minutes) into {}: {key}; log {}",
        dir.display(),
        log.display()
    );
    let t = Instant::now();
    let built = build(&tmp, &log).and_then(|_| {
        fs::rename(&tmp, &dir).or_else(|e| {
            // Another run finished first: keep its image.
            if dir.join("usr/bin/python3").exists() {
                Ok(())
            } else {
                Err(io("renaming into place", &dir)(e))
            }
        })
    });
    // Gone on success (renamed) and on failure alike; removing also clears a loser's copy.
    let _ = fs::remove_dir_all(&tmp);
    built?;
    Ok(DebianImage {
        root: dir,
        key,
        built_s: Some(t.elapsed().as_secs_f64()),
    })
}

/// A TCP connect to the mirror within 5 s (name resolution included).
fn mirror_reachable(host: &str) -> Result<(), DebianError> {
    let addrs = host
        .to_socket_addrs()
        .map_err(|e| DebianError::MirrorUnreachable(format!("resolving {host}: {e}")))?;
    let mut last = String::from("no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
            Ok(_) => return Ok(()),
            Err(e) => last = format!("connecting to {a}: {e}"),
        }
    }
    Err(DebianError::MirrorUnreachable(last))
}

fn build(tmp: &Path, log: &Path) -> Result<(), DebianError> {
    let _ = fs::remove_dir_all(tmp);
    let out = fs::File::create(log).map_err(io("creating", log))?;
    let err = out.try_clone().map_err(io("opening", log))?;
    let status = Command::new("debootstrap")
        .arg("--variant=minbase")
        .arg(format!("--include={}", PACKAGES.join(",")))
        .args([SUITE])
        .arg(tmp)
        .arg(MIRROR)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .status()
        .map_err(io("running debootstrap for", tmp))?;
    if !status.success() {
        return Err(DebianError::Debootstrap {
            status: status.to_string(),
            log: log.to_path_buf(),
        });
    }
    // As a published image would be: no downloaded packages or apt lists inside.
    for sub in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        let d = tmp.join(sub);
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_file() {
                fs::remove_file(&p).map_err(io("removing", &p))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names_every_package_and_the_dir_follows_it() {
        let k = key();
        assert!(PACKAGES.iter().all(|p| k.contains(p)));
        assert!(k.contains(SUITE) && k.contains(MIRROR));
        let root = Path::new("/c/perf");
        let a = image_dir(root, &k);
        assert_eq!(a, image_dir(root, &k));
        assert_ne!(a, image_dir(root, &format!("{k},python3-torch")));
        let name = a.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("debian-bookworm-") && name.len() == 16 + 16);
        assert!(a.starts_with(root));
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dsec-perf-debian-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_cached_image_is_used_without_debootstrap_or_mirror() {
        let cache = scratch("cached");
        let dir = image_dir(&cache, &key());
        fs::create_dir_all(dir.join("usr/bin")).unwrap();
        fs::write(dir.join("usr/bin/python3"), b"").unwrap();
        let img = ensure_in(&cache, &["/nonexistent/debootstrap"], "host.invalid:80").unwrap();
        assert_eq!((img.root, img.built_s), (dir, None));
        fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn missing_debootstrap_or_mirror_are_clear_errors_and_leave_nothing() {
        let cache = scratch("missing");
        let e = ensure_in(&cache, &["/nonexistent/debootstrap"], MIRROR_HOST).unwrap_err();
        assert!(matches!(e, DebianError::NoDebootstrap), "{e}");
        assert!(e.to_string().contains("apt-get install debootstrap"), "{e}");
        // Any existing file stands in for debootstrap: the mirror check comes first.
        let e = ensure_in(&cache, &["/proc/self/exe"], "host.invalid:80").unwrap_err();
        assert!(matches!(e, DebianError::MirrorUnreachable(_)), "{e}");
        assert!(e.to_string().contains("--image host"), "{e}");
        assert!(
            !cache.exists(),
            "nothing is created before the build starts"
        );
    }

    #[test]
    fn packages_are_sorted_and_unique() {
        let mut s = PACKAGES.to_vec();
        s.sort();
        s.dedup();
        assert_eq!(s, PACKAGES);
    }
}
