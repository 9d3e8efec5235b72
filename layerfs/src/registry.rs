//! Talking to a registry: HTTPS (system roots, or the CA in `DSEC_REGISTRY_CA`), plain HTTP
//! only for loopback registries that do not speak TLS, and authentication by the
//! registry's challenge: HTTP Basic, or a Bearer token fetched from the realm it names
//! (anonymously, or with the credentials `docker login` stored in
//! `$DOCKER_CONFIG/config.json` / `~/.docker/config.json`).

use std::collections::HashSet;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::Value;

use crate::error::{Error, Result};

/// Extra CA certificate(s) (PEM) trusted for registries instead of the system roots.
pub const CA_ENV: &str = "DSEC_REGISTRY_CA";

fn reg_err(url: &str, detail: impl std::fmt::Display) -> Error {
    Error::Registry {
        url: url.to_string(),
        detail: detail.to_string(),
    }
}

/// A user name and password for one registry host.
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <hidden>)", self.username)
    }
}

impl Credentials {
    fn basic_header(&self) -> String {
        let raw = format!("{}:{}", self.username, self.password);
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }

    /// The credentials `docker login` stored for `host`, if any.
    pub fn from_docker_config(host: &str) -> Result<Option<Credentials>> {
        let path = match std::env::var_os("DOCKER_CONFIG") {
            Some(dir) => PathBuf::from(dir).join("config.json"),
            None => match std::env::var_os("HOME") {
                Some(home) => PathBuf::from(home).join(".docker/config.json"),
                None => return Ok(None),
            },
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("reading registry credentials", &path, e)),
        };
        Self::from_docker_config_json(&text, host).map_err(|why| {
            Error::Invalid(format!(
                "{}: {why}; fix or remove the file (it is docker's credential file)",
                path.display()
            ))
        })
    }

    fn from_docker_config_json(
        text: &str,
        host: &str,
    ) -> std::result::Result<Option<Self>, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let Some(auths) = v["auths"].as_object() else {
            return Ok(None);
        };
        let entry = auths.iter().find(|(k, _)| {
            let k = k
                .trim_start_matches("https://")
                .trim_start_matches("http://");
            k.split('/').next() == Some(host)
        });
        let Some((_, entry)) = entry else {
            return Ok(None);
        };
        let Some(auth) = entry["auth"].as_str() else {
            return Ok(None);
        };
        let raw = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|e| format!("auth for {host} is not base64: {e}"))?;
        let raw = String::from_utf8(raw).map_err(|_| format!("auth for {host} is not UTF-8"))?;
        let (username, password) = raw
            .split_once(':')
            .ok_or_else(|| format!("auth for {host} is not user:password"))?;
        Ok(Some(Credentials {
            username: username.to_string(),
            password: password.to_string(),
        }))
    }
}

/// A parsed `WWW-Authenticate` challenge.
#[derive(Debug, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

impl Challenge {
    pub fn parse(header: &str) -> Option<Challenge> {
        let (scheme, params) = header.trim().split_once(' ').unwrap_or((header.trim(), ""));
        let mut realm = None;
        let mut service = None;
        let mut scope = None;
        // key="value" pairs; values may contain commas (scopes do), so split on quotes.
        let mut rest = params.trim();
        while let Some((key, after)) = rest.split_once('=') {
            let key = key
                .trim()
                .trim_start_matches(',')
                .trim()
                .to_ascii_lowercase();
            let after = after.trim_start();
            let (value, tail) = if let Some(quoted) = after.strip_prefix('"') {
                let end = quoted.find('"')?;
                (&quoted[..end], &quoted[end + 1..])
            } else {
                let end = after.find(',').unwrap_or(after.len());
                (&after[..end], &after[end..])
            };
            match key.as_str() {
                "realm" => realm = Some(value.to_string()),
                "service" => service = Some(value.to_string()),
                "scope" => scope = Some(value.to_string()),
                _ => {}
            }
            rest = tail;
        }
        match scheme.to_ascii_lowercase().as_str() {
            "basic" => Some(Challenge::Basic),
            "bearer" => Some(Challenge::Bearer {
                realm: realm?,
                service,
                scope,
            }),
            _ => None,
        }
    }
}

/// One registry host: its scheme, TLS trust, and the Authorization header once earned.
#[derive(Debug)]
pub struct Client {
    agent: ureq::Agent,
    host: String,
    scheme: &'static str,
    credentials: Option<Credentials>,
    authorization: Option<String>,
}

fn is_loopback(host: &str) -> bool {
    let name = host.rsplit_once(':').map_or(host, |(h, _)| h);
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// How to reach one registry: whom to trust and who we are.
#[derive(Clone, Debug, Default)]
pub struct ClientOptions {
    /// PEM CA certificate(s) trusted instead of the system roots.
    pub ca_file: Option<PathBuf>,
    pub credentials: Option<Credentials>,
}

impl ClientOptions {
    /// `DSEC_REGISTRY_CA` and docker's stored credentials for `host`.
    pub fn from_env(host: &str) -> Result<ClientOptions> {
        Ok(ClientOptions {
            ca_file: std::env::var_os(CA_ENV).map(PathBuf::from),
            credentials: Credentials::from_docker_config(host)?,
        })
    }
}

/// The distributions' CA bundles (Debian/Ubuntu/Alpine, Fedora/RHEL, others), as OpenSSL
/// would find them.
const SYSTEM_CA_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];
const SYSTEM_CA_DIR: &str = "/etc/ssl/certs";
/// A CA file larger than this is not a CA file; it is skipped rather than read whole.
const MAX_CA_FILE_BYTES: u64 = 16 << 20;

/// The system's trusted CAs, found where OpenSSL looks: the bundle (`SSL_CERT_FILE`, else
/// the distribution's) and every PEM file in `SSL_CERT_DIR` (default /etc/ssl/certs), so a
/// private CA copied there is trusted even before the bundle is rebuilt. Unreadable or
/// non-PEM files are skipped.
pub fn system_root_certs() -> Vec<ureq::tls::Certificate<'static>> {
    let bundle = std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .or_else(|| {
            SYSTEM_CA_BUNDLES
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        });
    let dirs: Vec<PathBuf> = match std::env::var_os("SSL_CERT_DIR") {
        Some(list) => std::env::split_paths(&list).collect(),
        None => vec![PathBuf::from(SYSTEM_CA_DIR)],
    };
    root_certs_from(bundle.as_deref(), &dirs)
}

/// Certificates of `bundle` and of the files in `dirs`, each file read once (the hash links
/// of a certificate directory point at the same files) and each certificate kept once.
fn root_certs_from(
    bundle: Option<&Path>,
    dirs: &[PathBuf],
) -> Vec<ureq::tls::Certificate<'static>> {
    let mut files_read = HashSet::new();
    let mut seen = HashSet::new();
    let mut certs = Vec::new();
    let mut add_file = |path: &Path| {
        let Ok(real) = path.canonicalize() else {
            return;
        };
        if !files_read.insert(real.clone()) {
            return;
        }
        let Ok(file) = std::fs::File::open(&real) else {
            return;
        };
        let mut pem = Vec::new();
        if file
            .take(MAX_CA_FILE_BYTES + 1)
            .read_to_end(&mut pem)
            .is_err()
            || pem.len() as u64 > MAX_CA_FILE_BYTES
        {
            return;
        }
        for item in ureq::tls::parse_pem(&pem) {
            if let Ok(ureq::tls::PemItem::Certificate(cert)) = item {
                if seen.insert(cert.der().to_vec()) {
                    certs.push(cert);
                }
            }
        }
    };
    if let Some(bundle) = bundle {
        add_file(bundle);
    }
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        paths.sort();
        for path in paths {
            add_file(&path);
        }
    }
    certs
}

/// TLS on rustls with ring (as everywhere in the workspace), trusting `roots`.
fn rustls_config(roots: ureq::tls::RootCerts) -> ureq::tls::TlsConfig {
    ureq::tls::TlsConfig::builder()
        .provider(ureq::tls::TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .root_certs(roots)
        .build()
}

/// TLS trusting the system's CAs ([`system_root_certs`]).
pub fn system_tls_config() -> ureq::tls::TlsConfig {
    rustls_config(ureq::tls::RootCerts::new_with_certs(&system_root_certs()))
}

/// The error of an HTTPS attempt, with what to do when rustls refused a CA certificate
/// served as the registry's own (what `openssl req -x509` makes without `-CA`).
fn explain_tls_error(err: ureq::Error) -> String {
    let text = err.to_string();
    if text.contains("CaUsedAsEndEntity") {
        format!(
            "{text}: the registry serves a CA certificate as its own; serve a certificate \
             signed by that CA (basicConstraints CA:FALSE) and trust the CA"
        )
    } else {
        text
    }
}

fn tls_config(ca_file: Option<&PathBuf>) -> Result<ureq::tls::TlsConfig> {
    let Some(path) = ca_file else {
        return Ok(system_tls_config());
    };
    let pem = std::fs::read(path).map_err(|e| Error::io("reading the registry CA", path, e))?;
    let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        return Err(Error::Invalid(format!(
            "{} (the registry CA file) holds no PEM certificate",
            path.display()
        )));
    }
    Ok(rustls_config(ureq::tls::RootCerts::new_with_certs(&certs)))
}

fn agent(ca_file: Option<&PathBuf>) -> Result<ureq::Agent> {
    Ok(ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_global(Some(Duration::from_secs(3600)))
        .tls_config(tls_config(ca_file)?)
        .build()
        .into())
}

impl Client {
    /// Connects to `host` and authenticates for `actions` (`pull` or `pull,push`) on `repo`.
    /// Trust and credentials from the environment ([`ClientOptions::from_env`]).
    pub fn connect(host: &str, repo: &str, actions: &str) -> Result<Client> {
        Self::connect_with(host, repo, actions, ClientOptions::from_env(host)?)
    }

    pub fn connect_with(
        host: &str,
        repo: &str,
        actions: &str,
        options: ClientOptions,
    ) -> Result<Client> {
        let agent = agent(options.ca_file.as_ref())?;
        let https = format!("https://{host}/v2/");
        let (scheme, resp) = match agent.get(&https).call().map_err(explain_tls_error) {
            Ok(resp) => ("https", resp),
            // Loopback registries may speak plain HTTP (a local registry or mirror);
            // anything else must be TLS.
            Err(tls_err) if is_loopback(host) => {
                let http = format!("http://{host}/v2/");
                match agent.get(&http).call() {
                    Ok(resp) if matches!(resp.status().as_u16(), 200 | 401) => ("http", resp),
                    // It answers, but not as a plain-HTTP registry: the TLS error is the news.
                    Ok(resp) => {
                        return Err(reg_err(
                            &https,
                            format!(
                                "{tls_err} (plain HTTP answered {}); trust the registry's CA \
                                 with {CA_ENV}=/path/ca.pem",
                                resp.status().as_u16()
                            ),
                        ))
                    }
                    Err(e) => {
                        return Err(reg_err(
                            &http,
                            format!("{e} (and over HTTPS: {tls_err}); is the registry running?"),
                        ))
                    }
                }
            }
            Err(e) => {
                return Err(reg_err(
                    &https,
                    format!(
                        "{e}; registries other than loopback ones are reached over HTTPS only \
                         (a private CA goes in {CA_ENV})"
                    ),
                ))
            }
        };
        let mut client = Client {
            agent,
            host: host.to_string(),
            scheme,
            credentials: options.credentials,
            authorization: None,
        };
        let status = resp.status().as_u16();
        if status == 401 {
            let header = resp
                .headers()
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            client.authorization = Some(client.authenticate(&header, repo, actions)?);
        } else if status != 200 {
            return Err(reg_err(
                &client.url("/v2/"),
                format!("HTTP {status} from the API root: not an OCI registry?"),
            ));
        }
        Ok(client)
    }

    fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.host)
    }

    /// `scheme://host/v2/repo`.
    pub fn base(&self, repo: &str) -> String {
        self.url(&format!("/v2/{repo}"))
    }

    /// Whether requests carry credentials or a token.
    pub fn is_authenticated(&self) -> bool {
        self.authorization.is_some()
    }

    pub fn scheme(&self) -> &str {
        self.scheme
    }

    fn authenticate(&self, header: &str, repo: &str, actions: &str) -> Result<String> {
        let root = self.url("/v2/");
        let need_login = |what: &str| {
            reg_err(
                &root,
                format!(
                    "the registry wants {what}; log in with `docker login {}` (credentials are \
                     read from $DOCKER_CONFIG/config.json or ~/.docker/config.json)",
                    self.host
                ),
            )
        };
        match Challenge::parse(header) {
            Some(Challenge::Basic) => match &self.credentials {
                Some(c) => {
                    let auth = c.basic_header();
                    let resp = self
                        .agent
                        .get(&root)
                        .header("Authorization", &auth)
                        .call()
                        .map_err(|e| reg_err(&root, e))?;
                    match resp.status().as_u16() {
                        200 => Ok(auth),
                        st => Err(reg_err(
                            &root,
                            format!(
                                "HTTP {st}: the registry refused the credentials stored for {}",
                                self.host
                            ),
                        )),
                    }
                }
                None => Err(need_login("a user name and password")),
            },
            Some(Challenge::Bearer {
                realm,
                service,
                scope: _,
            }) => {
                let mut url = format!(
                    "{realm}{}scope={}",
                    if realm.contains('?') { '&' } else { '?' },
                    urlencode(&format!("repository:{repo}:{actions}"))
                );
                if let Some(s) = service {
                    url.push_str(&format!("&service={}", urlencode(&s)));
                }
                let mut req = self.agent.get(&url);
                if let Some(c) = &self.credentials {
                    req = req.header("Authorization", &c.basic_header());
                }
                let mut resp = req.call().map_err(|e| reg_err(&url, e))?;
                let st = resp.status().as_u16();
                if st == 401 || st == 403 {
                    return Err(need_login(
                        "a token its auth server will not give anonymously",
                    ));
                }
                if st != 200 {
                    return Err(reg_err(&url, format!("token server answered HTTP {st}")));
                }
                let body = resp
                    .body_mut()
                    .with_config()
                    .limit(1 << 20)
                    .read_to_vec()
                    .map_err(|e| reg_err(&url, e))?;
                let v: Value = serde_json::from_slice(&body)
                    .map_err(|e| reg_err(&url, format!("token response is not JSON: {e}")))?;
                let token = v["token"]
                    .as_str()
                    .or_else(|| v["access_token"].as_str())
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| reg_err(&url, "token response has no token"))?;
                Ok(format!("Bearer {token}"))
            }
            None => Err(reg_err(
                &root,
                format!(
                    "HTTP 401 with an authentication scheme this client does not know: {header:?}"
                ),
            )),
        }
    }

    fn with_auth<B>(&self, mut req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        if let Some(a) = &self.authorization {
            req = req.header("Authorization", a);
        }
        req
    }

    pub fn get(&self, url: &str) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        self.with_auth(self.agent.get(url))
    }

    pub fn head(&self, url: &str) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        self.with_auth(self.agent.head(url))
    }

    pub fn post(&self, url: &str) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        self.with_auth(self.agent.post(url))
    }

    pub fn put(&self, url: &str) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        self.with_auth(self.agent.put(url))
    }
}

/// Percent-encodes a query value.
fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        assert_eq!(
            Challenge::parse(r#"Basic realm="Registry Realm""#),
            Some(Challenge::Basic)
        );
        assert_eq!(
            Challenge::parse(
                r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/busybox:pull,push""#
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/busybox:pull,push".into()),
            })
        );
        assert_eq!(Challenge::parse("Bearer service=\"x\""), None, "no realm");
        assert_eq!(Challenge::parse("Negotiate abc"), None);
        assert_eq!(Challenge::parse(""), None);
    }

    #[test]
    fn docker_config_credentials() {
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cr:et");
        let cfg = format!(r#"{{"auths": {{"https://reg.example:5000": {{"auth": "{auth}"}}}}}}"#);
        let c = Credentials::from_docker_config_json(&cfg, "reg.example:5000")
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.username.as_str(), c.password.as_str()),
            ("alice", "s3cr:et")
        );
        assert!(Credentials::from_docker_config_json(&cfg, "other:5000")
            .unwrap()
            .is_none());
        assert!(Credentials::from_docker_config_json("{", "x").is_err());
        let bad = r#"{"auths": {"x": {"auth": "!!"}}}"#;
        assert!(Credentials::from_docker_config_json(bad, "x").is_err());
        assert!(!format!("{c:?}").contains("s3cr"), "password in Debug");
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost:5000",
            "127.0.0.1:5000",
            "[::1]:5000",
            "127.0.0.1",
        ] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["registry.example:5000", "10.0.0.1:5000", "docker.io"] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn query_encoding() {
        assert_eq!(
            urlencode("repository:a/b:pull,push"),
            "repository%3Aa%2Fb%3Apull%2Cpush"
        );
    }
}
