//! The node's FnCall factory on a host whose KVM cannot run a Linux guest (PVM, or no
//! /dev/kvm): a call naming a VM FnCall image is refused with FAILED_PRECONDITION and the
//! reason, before any VMM starts. (On a hardware-KVM host the VM mode is tested in the rig:
//! tests/rig/tests/fncall-vm.sh.)

use std::sync::Arc;

use dsec_edge::daemon::fncall::factory;
use dsec_edge::kvm::KvmStatus;
use dsec_edge::Artifacts;
use dsec_fncall::{CallRequest, Engine, EngineConfig, FnCallError, Language};

/// The host's KVM status and a DSEC_HOME holding a VM image (an empty initramfs: it never
/// boots), or None (skipped) on a host that runs Linux guests.
fn home_with_a_vm_image() -> Option<(KvmStatus, tempfile::TempDir)> {
    let kvm = KvmStatus::detect();
    if kvm.can_run_linux_guest() {
        eprintln!("skipped: this host runs Linux guests; the rig suite fncall-vm covers it");
        return None;
    }
    let home = tempfile::tempdir().unwrap();
    let image = home.path().join("images/fncall-vm");
    std::fs::create_dir_all(&image).unwrap();
    std::fs::write(image.join("initramfs.cpio"), b"").unwrap();
    std::fs::write(image.join(dsec_fncall::vm::VM_IMAGE_MARKER), b"").unwrap();
    Some((kvm, home))
}

#[tokio::test]
async fn vm_calls_are_refused_where_linux_guests_cannot_run() {
    let Some((kvm, home)) = home_with_a_vm_image() else {
        return;
    };
    let run_dir = home.path().join("run");
    let engine = Engine::new(
        EngineConfig::default(),
        Arc::new(factory(&Artifacts::under(home.path()), &run_dir, None, 1)),
    );
    let call = CallRequest::new(Language::Python, "print(1)");
    let err = engine.run_in("fncall-vm", &call).await.unwrap_err();
    assert!(matches!(err, FnCallError::NoVmSupport(_)), "{err}");
    let status = dsec_fncall::grpc::status(&err);
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status.message().contains("cannot run VM workers")
            && status.message().contains(&kvm.why_not_microvm().unwrap()),
        "{}",
        status.message()
    );
    // Refused before anything started: no template, no VMM directory.
    let started = std::fs::read_dir(&run_dir)
        .map(|d| d.flatten().count())
        .unwrap_or(0);
    assert_eq!(
        started,
        0,
        "the refusal left files under {}",
        run_dir.display()
    );
}

/// SandboxFusion's `POST /run_code` with our `image` field names the VM image: on this host the
/// answer is a `SandboxError` whose message gives the reason (not the default image's).
#[tokio::test]
async fn sandboxfusion_calls_naming_a_vm_image_are_refused_where_linux_guests_cannot_run() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some((kvm, home)) = home_with_a_vm_image() else {
        return;
    };
    let engine = Arc::new(Engine::new(
        EngineConfig::default(),
        Arc::new(factory(
            &Artifacts::under(home.path()),
            &home.path().join("run"),
            None,
            1,
        )),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(dsec_fncall::sandboxfusion::serve(listener, engine));
    let body = r#"{"code":"print(1)","language":"python","image":"fncall-vm"}"#;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    server.abort();
    let json = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let reply: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| {
        panic!("not a JSON answer ({e}): {answer}");
    });
    assert_eq!(reply["status"], "SandboxError", "{reply}");
    let message = reply["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("cannot run VM workers")
            && message.contains(&kvm.why_not_microvm().unwrap()),
        "{message}"
    );
}
