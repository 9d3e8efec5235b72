//! Test support shared by this crate's and the CLI's tests: a real OCI registry (Debian's
//! `docker-registry`) on 127.0.0.1 with its own config and storage, killed and removed on
//! drop. Plain HTTP, or TLS (a self-signed certificate for 127.0.0.1) with htpasswd Basic
//! auth.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const REGISTRY: &str = "/usr/bin/docker-registry";

pub struct LocalRegistry {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// The registry's self-signed certificate, when it speaks TLS.
    pub ca: Option<PathBuf>,
    dir: PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

fn missing(tools: &[&str]) -> bool {
    match tools.iter().find(|t| !Path::new(t).exists()) {
        Some(tool) => {
            eprintln!("SKIPPED: {tool} not installed (setup.sh installs docker-registry, openssl, apache2-utils)");
            true
        }
        None => false,
    }
}

impl LocalRegistry {
    /// A plain-HTTP registry, up and answering; None (with a SKIPPED line) when
    /// docker-registry is not installed.
    pub fn start() -> Option<LocalRegistry> {
        if missing(&[REGISTRY]) {
            return None;
        }
        let reg = Self::spawn_in(Self::scratch(), "", None);
        let url = format!("http://{}/v2/", reg.addr);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !crate::oci::agent()
            .get(&url)
            .call()
            .is_ok_and(|r| r.status().as_u16() == 200)
        {
            assert!(
                Instant::now() < deadline,
                "registry did not come up on {}",
                reg.addr
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(reg)
    }

    /// A registry that speaks only TLS and wants HTTP Basic credentials `user:password`
    /// (htpasswd, bcrypt); listening once this returns.
    pub fn start_secure(user: &str, password: &str) -> Option<LocalRegistry> {
        if missing(&[REGISTRY, "/usr/bin/openssl", "/usr/bin/htpasswd"]) {
            return None;
        }
        let dir = Self::scratch();
        let (cert, key, htpasswd) = (
            dir.join("cert.pem"),
            dir.join("key.pem"),
            dir.join("htpasswd"),
        );
        let out = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args([
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("run openssl");
        assert!(out.status.success(), "openssl: {out:?}");
        let out = Command::new("htpasswd")
            .args(["-Bbn", user, password])
            .output()
            .expect("run htpasswd");
        assert!(out.status.success(), "htpasswd: {out:?}");
        std::fs::write(&htpasswd, &out.stdout).expect("write htpasswd");
        let extra = format!(
            "auth:\n  htpasswd:\n    realm: test\n    path: {}\n",
            htpasswd.display()
        );
        let tls = format!(
            "  tls:\n    certificate: {}\n    key: {}\n",
            cert.display(),
            key.display()
        );
        let reg = Self::spawn_in(dir, &extra, Some((tls, cert)));
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&reg.addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "registry did not come up on {}",
                reg.addr
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(reg)
    }

    fn scratch() -> PathBuf {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "dsec-registry-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the registry's scratch dir");
        dir
    }

    /// Starts docker-registry on a free port with storage under `dir`; `extra` goes into
    /// the config's top level, `tls` (config lines under `http:`, certificate) makes it TLS.
    fn spawn_in(dir: PathBuf, extra: &str, tls: Option<(String, PathBuf)>) -> LocalRegistry {
        let addr = format!("127.0.0.1:{}", free_port());
        let (tls_cfg, ca) = match tls {
            Some((cfg, ca)) => (cfg, Some(ca)),
            None => (String::new(), None),
        };
        let cfg = dir.join("config.yml");
        std::fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n{extra}http:\n  addr: {addr}\n{tls_cfg}",
                dir.join("data").display()
            ),
        )
        .expect("write the registry config");
        let child = Command::new(REGISTRY)
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start docker-registry");
        LocalRegistry {
            child,
            addr,
            ca,
            dir,
        }
    }

    /// `127.0.0.1:PORT/REPO:TAG` as a parsed reference.
    pub fn reference(&self, repo_tag: &str) -> crate::oci::Reference {
        crate::oci::Reference::parse(&format!("{}/{repo_tag}", self.addr)).expect("valid reference")
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
