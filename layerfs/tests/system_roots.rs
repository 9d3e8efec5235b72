//! A registry whose private CA is in the system's certificate directory is trusted without
//! `DSEC_REGISTRY_CA` (OpenSSL's lookup: `SSL_CERT_FILE`, then the files of `SSL_CERT_DIR`).
//! One test in this binary: it sets those variables for the whole process.

use dsec_layerfs::registry::{self, ClientOptions, Credentials};
use dsec_layerfs::testing::LocalRegistry;

#[test]
fn private_ca_in_the_system_cert_dir_is_trusted() {
    let Some(reg) = LocalRegistry::start_secure("alice", "s3cret") else {
        return;
    };
    let certs = tempfile::tempdir().unwrap();
    std::env::set_var("SSL_CERT_FILE", certs.path().join("no-bundle.crt"));
    std::env::set_var("SSL_CERT_DIR", certs.path());
    let connect = || {
        registry::Client::connect_with(
            &reg.addr,
            "test/busybox",
            "pull",
            ClientOptions {
                ca_file: None,
                credentials: Some(Credentials {
                    username: "alice".into(),
                    password: "s3cret".into(),
                }),
            },
        )
    };

    // Not yet in the directory: refused over TLS, never retried as plain HTTP.
    let err = connect().unwrap_err().to_string();
    assert!(err.to_lowercase().contains("certificate"), "{err}");

    let ca = reg.ca.as_ref().expect("a TLS registry has a CA");
    std::fs::copy(ca, certs.path().join("private-registry-ca.crt")).unwrap();
    assert_eq!(registry::system_root_certs().len(), 1);
    let client = connect().unwrap();
    assert_eq!(client.scheme(), "https");
    assert!(client.is_authenticated());
}
