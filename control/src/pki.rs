//! The cluster CA and the certificates it signs: `dsec control init --tls-dir DIR` makes the
//! CA and the apiservers' certificate, `dsec control issue-node` one node's. Keys are ECDSA
//! P-256, written 0600; the CA key stays in the apiservers' directory.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use dsec_api::tls::{node_server_name, APISERVER_NAME};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Years a certificate is valid from the day it is made.
const CA_YEARS: i32 = 10;
const LEAF_YEARS: i32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{0} already exists: this directory holds a cluster CA; use another --tls-dir or remove it to start a new cluster")]
    Exists(PathBuf),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read {path}: {source} (is it the --tls-dir `dsec control init` wrote?)")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{0:?} is not a usable subject name (an IP address or a DNS name)")]
    BadName(String),
}

/// This year (UTC), from the clock; validity runs from its first day.
fn this_year() -> i32 {
    let days = crate::now_ms() / 86_400_000;
    1970 + (days as f64 / 365.2425) as i32
}

fn validity(params: &mut CertificateParams, years: i32) {
    let year = this_year();
    params.not_before = rcgen::date_time_ymd(year, 1, 1);
    params.not_after = rcgen::date_time_ymd(year + years, 1, 1);
}

fn serial(params: &mut CertificateParams) {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("the OS random source failed");
    bytes[0] &= 0x7f;
    params.serial_number = Some(rcgen::SerialNumber::from_slice(&bytes));
}

/// The CA's subject; signing later rebuilds it from here (the issuer name and key id come
/// from the CA's key, which does not change). The name carries a digest of the key, so that
/// another cluster's CA has another name and its certificates read as "unknown issuer".
fn ca_params(ca_key: &KeyPair) -> CertificateParams {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(ca_key.public_key_raw());
    let id: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("dsec cluster CA {id}"));
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, CA_YEARS);
    params
}

fn write_file(path: &Path, contents: &str, mode: u32) -> Result<(), PkiError> {
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(path)?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()
    };
    write().map_err(|source| PkiError::Write {
        path: path.to_path_buf(),
        source,
    })
}

fn read_file(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|source| PkiError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn check_names(names: &[String]) -> Result<(), PkiError> {
    for name in names {
        if name.is_empty()
            || name.len() > 253
            || name.contains(['/', ' ', ',', ':']) && name.parse::<std::net::IpAddr>().is_err()
        {
            return Err(PkiError::BadName(name.clone()));
        }
    }
    Ok(())
}

/// Signs a leaf certificate for `names` (server and client use) and writes `<role>.pem`,
/// `<role>.key` and a copy of `ca.pem` into `out`; returns the certificate's SHA-256
/// fingerprint.
fn issue(
    ca_dir: &Path,
    out: &Path,
    role: &str,
    common_name: &str,
    names: Vec<String>,
) -> Result<String, PkiError> {
    check_names(&names)?;
    let ca_key = KeyPair::from_pem(&read_file(&ca_dir.join("ca.key"))?)?;
    let ca_pem = read_file(&ca_dir.join("ca.pem"))?;
    let issuer = Issuer::new(ca_params(&ca_key), ca_key);
    let mut params = CertificateParams::new(names)?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, LEAF_YEARS);
    serial(&mut params);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    std::fs::create_dir_all(out).map_err(|source| PkiError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    write_file(
        &out.join(format!("{role}.key")),
        &key.serialize_pem(),
        0o600,
    )?;
    write_file(&out.join(format!("{role}.pem")), &cert.pem(), 0o644)?;
    if out != ca_dir {
        write_file(&out.join("ca.pem"), &ca_pem, 0o644)?;
    }
    Ok(dsec_api::tls::fingerprint(cert.der()))
}

/// A new cluster CA in `dir` (refused if one is there) and the apiservers' certificate, valid
/// for `apiserver.dsec`, localhost, 127.0.0.1 and `extra_names` (the addresses clients use).
pub fn init(dir: &Path, extra_names: &[String]) -> Result<(), PkiError> {
    check_names(extra_names)?;
    let ca_pem_path = dir.join("ca.pem");
    if ca_pem_path.exists() {
        return Err(PkiError::Exists(ca_pem_path));
    }
    std::fs::create_dir_all(dir).map_err(|source| PkiError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let ca_key = KeyPair::generate()?;
    let mut params = ca_params(&ca_key);
    serial(&mut params);
    let ca = params.self_signed(&ca_key)?;
    write_file(&dir.join("ca.key"), &ca_key.serialize_pem(), 0o600)?;
    write_file(&ca_pem_path, &ca.pem(), 0o644)?;
    let mut names = vec![
        APISERVER_NAME.to_string(),
        "localhost".to_string(),
        "127.0.0.1".to_string(),
    ];
    names.extend(extra_names.iter().cloned());
    issue(dir, dir, "apiserver", "dsec apiserver", names).map(drop)
}

/// Apiserver replica `name`'s own certificate, signed by the CA in `ca_dir` and written to `out`
/// as `apiserver.pem`, `apiserver.key` and `ca.pem` (its `dsec control up --tls-dir OUT`):
/// valid for `apiserver.dsec` (so nodes take it), `<name>.apiserver.dsec` (so it can be
/// revoked by name), localhost, 127.0.0.1 and `extra_names`. Returns its SHA-256
/// fingerprint.
pub fn issue_apiserver(
    ca_dir: &Path,
    out: &Path,
    name: &str,
    extra_names: &[String],
) -> Result<String, PkiError> {
    if !crate::revocation::valid_replica_name(name) {
        return Err(PkiError::BadName(name.to_string()));
    }
    let mut names = vec![
        APISERVER_NAME.to_string(),
        dsec_api::tls::apiserver_replica_name(name),
        "localhost".to_string(),
        "127.0.0.1".to_string(),
    ];
    names.extend(extra_names.iter().cloned());
    issue(
        ca_dir,
        out,
        "apiserver",
        &format!("dsec apiserver {name}"),
        names,
    )
}

/// A certificate for node `node` signed by the CA in `ca_dir`, written to `out` as
/// `node.pem`, `node.key` and `ca.pem` (what the node's `--tls-dir` needs).
pub fn issue_node(ca_dir: &Path, out: &Path, node: &str) -> Result<(), PkiError> {
    if !dsec_api::sandbox_id::valid_node_name(node) {
        return Err(PkiError::BadName(node.to_string()));
    }
    issue(
        ca_dir,
        out,
        "node",
        &format!("dsec node {node}"),
        vec![node_server_name(node)],
    )
    .map(drop)
}
