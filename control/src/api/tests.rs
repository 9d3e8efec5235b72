//! Unit tests of the apiserver's request parsing: bearer tokens, the project of a call, node
//! records and the certificate-name check of the node registry.

use dsec_api::node::v1 as pb;
use tonic::metadata::MetadataMap;

use super::auth::{bearer, project, ProjectCache};
use super::nodes::{names_dns, record_of};

fn metadata(pairs: &[(&'static str, &str)]) -> MetadataMap {
    let mut map = MetadataMap::new();
    for (k, v) in pairs {
        map.insert(*k, v.parse().unwrap());
    }
    map
}

#[test]
fn bearer_tokens_are_read_and_bad_ones_say_what_is_wrong() {
    let ok = bearer(&metadata(&[("authorization", "Bearer dsec_ab_cd")])).unwrap();
    assert_eq!(ok, "dsec_ab_cd");
    assert_eq!(
        bearer(&metadata(&[("authorization", "bearer  x ")])).unwrap(),
        "x"
    );
    let missing = bearer(&MetadataMap::new()).unwrap_err();
    assert_eq!(missing.code(), tonic::Code::Unauthenticated);
    assert!(missing.message().contains("DSEC_TOKEN"), "{missing:?}");
    let basic = bearer(&metadata(&[("authorization", "Basic abc")])).unwrap_err();
    assert_eq!(basic.code(), tonic::Code::Unauthenticated);
    assert!(basic.message().contains("Bearer TOKEN"), "{basic:?}");
}

#[test]
fn the_project_comes_from_the_field_else_the_metadata() {
    let md = metadata(&[("x-dsec-project", "acme/b")]);
    assert_eq!(project("acme/a", &md).unwrap().to_string(), "acme/a");
    assert_eq!(project("", &md).unwrap().to_string(), "acme/b");
    let none = project("", &MetadataMap::new()).unwrap_err();
    assert_eq!(none.code(), tonic::Code::InvalidArgument);
    assert!(none.message().contains("x-dsec-project"), "{none:?}");
    let bad = project("acme//x", &MetadataMap::new()).unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
}

#[test]
fn node_records_need_a_usable_address() {
    let info = |address: &str| pb::NodeInfo {
        name: "n1".into(),
        address: address.into(),
        backends: vec!["container".into(), "quantum".into()],
        ..Default::default()
    };
    let record = record_of(Some(info("10.0.0.1:7070"))).unwrap();
    assert_eq!(record.backends.len(), 1, "unknown backends are left out");
    for bad in ["", &"x".repeat(257)] {
        let e = record_of(Some(info(bad))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }
    assert_eq!(
        record_of(None).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
}

#[test]
fn a_certificate_names_a_node_only_as_a_whole_dns_entry() {
    let mut der = vec![0x30, 0x10];
    let name = b"n1.node.dsec";
    der.extend_from_slice(&[0x82, name.len() as u8]);
    der.extend_from_slice(name);
    assert!(names_dns(&der, "n1.node.dsec"));
    // A suffix of another node's name, or the name without its entry tag, is not it.
    assert!(!names_dns(&der, "1.node.dsec"));
    let mut xn1 = vec![0x82, 13];
    xn1.extend_from_slice(b"xn1.node.dsec");
    assert!(!names_dns(&xn1, "n1.node.dsec"));
    assert!(!names_dns(name, "n1.node.dsec"));
    assert!(!names_dns(&der, &"a".repeat(200)));
}

#[test]
fn the_project_cache_is_bounded() {
    let cache = ProjectCache::default();
    let path: crate::iam::ProjectPath = "acme/a".parse().unwrap();
    cache.insert("sb-n1-aaaaaaaaaaaa", path.clone());
    assert_eq!(cache.get("sb-n1-aaaaaaaaaaaa"), Some(path.clone()));
    cache.forget("sb-n1-aaaaaaaaaaaa");
    assert_eq!(cache.get("sb-n1-aaaaaaaaaaaa"), None);
    for i in 0..200_001 {
        cache.insert(&format!("sb-n1-{i}"), path.clone());
    }
    assert!(cache.len() <= 200_000);
}
