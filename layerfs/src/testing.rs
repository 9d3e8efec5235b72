//! Test support shared by this crate's and the CLI's tests: a real OCI registry (Debian's
//! `docker-registry`) on 127.0.0.1 with its own config and storage, killed and removed on
//! drop. Plain HTTP, TLS (a private CA's certificate for 127.0.0.1) with htpasswd Basic
//! auth, or token auth: the registry trusts RS256 tokens from a small token server here
//! (the flow of Docker Hub, GHCR and most hosted registries).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const REGISTRY: &str = "/usr/bin/docker-registry";

pub struct LocalRegistry {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// The CA that signed the registry's certificate, when it speaks TLS.
    pub ca: Option<PathBuf>,
    dir: PathBuf,
    /// The token server of a token-auth registry.
    pub tokens: Option<TokenServer>,
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
        let (ca, ca_key, cert, key, htpasswd) = (
            dir.join("ca.pem"),
            dir.join("ca.key"),
            dir.join("cert.pem"),
            dir.join("key.pem"),
            dir.join("htpasswd"),
        );
        // A private CA and a server certificate for 127.0.0.1 it signed (what a private
        // registry has; rustls refuses a CA certificate as the server's own).
        let openssl_req = |subject: &str, key: &Path, out: &Path, extra: &[&std::ffi::OsStr]| {
            let status = Command::new("openssl")
                .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
                .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
                .args(["-subj", subject])
                .args(extra)
                .arg("-keyout")
                .arg(key)
                .arg("-out")
                .arg(out)
                .output()
                .expect("run openssl");
            assert!(status.status.success(), "openssl: {status:?}");
        };
        openssl_req("/CN=dsec-test-registry-ca", &ca_key, &ca, &[]);
        openssl_req(
            "/CN=127.0.0.1",
            &key,
            &cert,
            &[
                "-CA".as_ref(),
                ca.as_os_str(),
                "-CAkey".as_ref(),
                ca_key.as_os_str(),
                "-addext".as_ref(),
                "subjectAltName=IP:127.0.0.1".as_ref(),
                "-addext".as_ref(),
                "basicConstraints=critical,CA:FALSE".as_ref(),
            ],
        );
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
        let reg = Self::spawn_in(dir, &extra, Some((tls, ca)));
        reg.wait_listening();
        Some(reg)
    }

    /// A plain-HTTP registry that wants Bearer tokens from its own token server, which
    /// gives each `(user, password, actions)` account at most those actions (e.g. "pull" or
    /// "pull,push") on any repository, and nothing to anyone else.
    pub fn start_token_auth(accounts: &[(&str, &str, &str)]) -> Option<LocalRegistry> {
        if missing(&[REGISTRY, "/usr/bin/openssl"]) {
            return None;
        }
        let dir = Self::scratch();
        let (cert, key) = (dir.join("token.pem"), dir.join("token.key"));
        let out = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args(["-subj", "/CN=dsec-test-token-issuer"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("run openssl");
        assert!(out.status.success(), "openssl: {out:?}");
        let tokens = TokenServer::start(&cert, &key, accounts);
        let extra = format!(
            "auth:\n  token:\n    realm: http://{}/token\n    service: {TOKEN_SERVICE}\n    issuer: {TOKEN_ISSUER}\n    rootcertbundle: {}\n",
            tokens.addr,
            cert.display()
        );
        let mut reg = Self::spawn_in(dir, &extra, None);
        reg.tokens = Some(tokens);
        reg.wait_listening();
        Some(reg)
    }

    /// Until the registry accepts connections (a TLS or token registry answers nothing
    /// useful without credentials, so a connect is the readiness test).
    fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&self.addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "registry did not come up on {}",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(100));
        }
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
            tokens: None,
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

const TOKEN_SERVICE: &str = "dsec-test-registry";
const TOKEN_ISSUER: &str = "dsec-test-token-issuer";

/// A minimal registry token server (the Docker token protocol): `GET /token?scope=
/// repository:NAME:ACTIONS&service=S` with HTTP Basic credentials answers
/// `{"token": JWT}`, the JWT signed RS256 (by `openssl dgst`) with the key whose certificate
/// the registry trusts, carried in the `x5c` header. Unknown or wrong credentials get 401.
pub struct TokenServer {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Tokens handed out so far.
    pub issued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct TokenSigner {
    key: PathBuf,
    cert_der_b64: String,
    accounts: Vec<(String, String, Vec<String>)>,
}

fn b64url(data: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data)
}

fn url_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl TokenSigner {
    /// The HTTP status and body for one token request.
    fn answer(&self, target: &str, authorization: Option<&str>) -> (u16, String) {
        use base64::Engine as _;
        let query = target.split_once('?').map_or("", |(_, q)| q);
        let param = |name: &str| {
            query
                .split('&')
                .filter_map(|kv| kv.split_once('='))
                .find(|(k, _)| *k == name)
                .map(|(_, v)| url_decode(v))
        };
        let user = authorization
            .and_then(|a| a.strip_prefix("Basic "))
            .and_then(|b| {
                base64::engine::general_purpose::STANDARD
                    .decode(b.trim())
                    .ok()
            })
            .and_then(|raw| String::from_utf8(raw).ok())
            .and_then(|up| {
                let (u, p) = up.split_once(':')?;
                self.accounts
                    .iter()
                    .find(|(au, ap, _)| au == u && ap == p)
                    .cloned()
            });
        let Some((user, _, allowed)) = user else {
            return (401, r#"{"details":"credentials required"}"#.into());
        };
        let mut access = Vec::new();
        if let Some(scope) = param("scope") {
            let mut parts = scope.splitn(3, ':');
            if let (Some("repository"), Some(name), Some(actions)) =
                (parts.next(), parts.next(), parts.next())
            {
                let granted: Vec<&str> = actions
                    .split(',')
                    .filter(|a| allowed.iter().any(|x| x == a))
                    .collect();
                access.push(serde_json::json!({
                    "type": "repository", "name": name, "actions": granted
                }));
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let header = serde_json::json!({"alg": "RS256", "typ": "JWT", "x5c": [self.cert_der_b64]});
        let claims = serde_json::json!({
            "iss": TOKEN_ISSUER, "sub": user, "aud": param("service").unwrap_or_default(),
            "exp": now + 300, "nbf": now - 10, "iat": now - 10,
            "jti": format!("{now}-{}", std::process::id()), "access": access,
        });
        let input = format!(
            "{}.{}",
            b64url(header.to_string().as_bytes()),
            b64url(claims.to_string().as_bytes())
        );
        let mut child = Command::new("openssl")
            .args(["dgst", "-sha256", "-binary", "-sign"])
            .arg(&self.key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run openssl dgst");
        {
            use std::io::Write as _;
            let mut stdin = child.stdin.take().expect("piped stdin");
            stdin.write_all(input.as_bytes()).expect("feed openssl");
        }
        let out = child.wait_with_output().expect("openssl dgst");
        assert!(out.status.success(), "openssl dgst: {out:?}");
        let token = format!("{input}.{}", b64url(&out.stdout));
        (
            200,
            serde_json::json!({"token": token, "expires_in": 300}).to_string(),
        )
    }
}

impl TokenServer {
    fn start(cert: &Path, key: &Path, accounts: &[(&str, &str, &str)]) -> TokenServer {
        use base64::Engine as _;
        let der = Command::new("openssl")
            .args(["x509", "-outform", "DER", "-in"])
            .arg(cert)
            .output()
            .expect("run openssl x509");
        assert!(der.status.success(), "openssl x509: {der:?}");
        let signer = TokenSigner {
            key: key.to_path_buf(),
            cert_der_b64: base64::engine::general_purpose::STANDARD.encode(&der.stdout),
            accounts: accounts
                .iter()
                .map(|(u, p, a)| {
                    (
                        u.to_string(),
                        p.to_string(),
                        a.split(',').map(String::from).collect(),
                    )
                })
                .collect(),
        };
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the token server");
        let addr = listener
            .local_addr()
            .expect("token server address")
            .to_string();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let issued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let thread = {
            let (stop, issued) = (stop.clone(), issued.clone());
            std::thread::spawn(move || {
                use std::io::{BufRead, BufReader, Write};
                use std::sync::atomic::Ordering;
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut stream) = stream else { continue };
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                    let mut request = String::new();
                    let _ = reader.read_line(&mut request);
                    let mut authorization = None;
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':') {
                            if k.eq_ignore_ascii_case("authorization") {
                                authorization = Some(v.trim().to_string());
                            }
                        }
                    }
                    let target = request.split_whitespace().nth(1).unwrap_or("");
                    let (status, body) = if target.starts_with("/token") {
                        signer.answer(target, authorization.as_deref())
                    } else {
                        (404, "{}".into())
                    };
                    if status == 200 {
                        issued.fetch_add(1, Ordering::SeqCst);
                    }
                    let reason = match status {
                        200 => "OK",
                        401 => "Unauthorized",
                        _ => "Not Found",
                    };
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
            })
        };
        TokenServer {
            addr,
            issued,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = std::net::TcpStream::connect(&self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
