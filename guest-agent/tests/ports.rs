//! The agent's Ports service as a plain process (it shares the host's loopback, so the test's
//! own TCP servers stand in for servers inside a sandbox): half-close in both directions and
//! the errors of bad streams.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener};
use std::time::Duration;

use dsec_api::agent::v1::ports_client::PortsClient;
use dsec_api::agent::v1::{port_request, port_response, PortEof, PortOpen, PortRequest};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

mod common;
use common::Agent;

fn open(port: u32) -> PortRequest {
    PortRequest {
        kind: Some(port_request::Kind::Open(PortOpen { port })),
    }
}

fn data(bytes: &[u8]) -> PortRequest {
    PortRequest {
        kind: Some(port_request::Kind::Data(bytes.to_vec())),
    }
}

fn eof() -> PortRequest {
    PortRequest {
        kind: Some(port_request::Kind::Eof(PortEof {})),
    }
}

/// The response kinds of a stream, data merged, until it ends (or its error).
async fn collect(
    mut stream: tonic::Streaming<dsec_api::agent::v1::PortResponse>,
) -> Result<(Vec<u8>, usize), tonic::Status> {
    let (mut bytes, mut eofs) = (Vec::new(), 0);
    while let Some(m) = stream.message().await? {
        match m.kind {
            Some(port_response::Kind::Data(d)) => bytes.extend_from_slice(&d),
            Some(port_response::Kind::Eof(_)) => eofs += 1,
            _ => {}
        }
    }
    Ok((bytes, eofs))
}

#[tokio::test]
async fn half_close_works_both_ways() {
    let agent = Agent::start("ports-halfclose").await;
    let mut ports = PortsClient::new(agent.client.channel());

    // Client -> server half-close: the server reads to EOF, then answers, then closes.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        socket.read_to_end(&mut got).unwrap();
        socket
            .write_all(format!("read {} bytes", got.len()).as_bytes())
            .unwrap();
    });
    let messages = vec![open(port.into()), data(b"abc"), data(b"defg"), eof()];
    let stream = ports
        .open(tokio_stream::iter(messages))
        .await
        .unwrap()
        .into_inner();
    // A missing half-close would leave the server reading forever: bounded, not a hang.
    let (bytes, eofs) = tokio::time::timeout(Duration::from_secs(10), collect(stream))
        .await
        .expect("the server never saw EOF")
        .unwrap();
    assert_eq!(bytes, b"read 7 bytes");
    assert_eq!(eofs, 1);
    server.join().unwrap();

    // Server -> client half-close first: the server says hello and shuts its write side, the
    // client still sends afterwards and the server receives it.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        socket.write_all(b"hello").unwrap();
        socket.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        socket.read_to_end(&mut got).unwrap();
        got
    });
    let (tx, rx) = mpsc::channel(4);
    tx.send(open(port.into())).await.unwrap();
    let mut stream = ports
        .open(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut hello = Vec::new();
    loop {
        match stream.message().await.unwrap().unwrap().kind {
            Some(port_response::Kind::Data(d)) => hello.extend_from_slice(&d),
            Some(port_response::Kind::Eof(_)) => break,
            _ => {}
        }
    }
    assert_eq!(hello, b"hello");
    tx.send(data(b"after your eof")).await.unwrap();
    // Ending the request stream counts as eof.
    drop(tx);
    let (rest, eofs) = tokio::time::timeout(Duration::from_secs(10), collect(stream))
        .await
        .expect("the stream did not end once both sides were closed")
        .unwrap();
    assert!(rest.is_empty());
    assert_eq!(eofs, 0);
    assert_eq!(server.join().unwrap(), b"after your eof");
}

#[tokio::test]
async fn servers_on_ipv6_loopback_are_reached_too() {
    let agent = Agent::start("ports-ipv6").await;
    let mut ports = PortsClient::new(agent.client.channel());
    let Ok(listener) = TcpListener::bind("[::1]:0") else {
        eprintln!("SKIPPED: no IPv6 loopback on this host");
        return;
    };
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        socket.write_all(b"over ::1").unwrap();
    });
    let stream = ports
        .open(tokio_stream::iter(vec![open(port.into()), eof()]))
        .await
        .unwrap()
        .into_inner();
    let (bytes, _) = tokio::time::timeout(Duration::from_secs(10), collect(stream))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(bytes, b"over ::1");
    server.join().unwrap();
}

#[tokio::test]
async fn bad_streams_get_clear_errors() {
    let agent = Agent::start("ports-errors").await;
    let mut ports = PortsClient::new(agent.client.channel());

    // Nothing listens: a port that was just free.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = ports
        .open(tokio_stream::iter(vec![open(port.into())]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(
        err.message()
            .starts_with(&format!("nothing listens on port {port}")),
        "{}",
        err.message()
    );

    for bad in [0, 65536] {
        let err = ports
            .open(tokio_stream::iter(vec![open(bad)]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("give 1-65535"), "{}", err.message());
    }

    let err = ports
        .open(tokio_stream::iter(vec![data(b"x")]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("must be `open`"),
        "{}",
        err.message()
    );

    // After `open`: a second open, and a chunk over 1 MiB, end the stream with an error.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port: u32 = listener.local_addr().unwrap().port().into();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut socket, _) = listener.accept().unwrap();
            let mut sink = Vec::new();
            let _ = socket.read_to_end(&mut sink);
        }
    });
    let stream = ports
        .open(tokio_stream::iter(vec![open(port), open(port)]))
        .await
        .unwrap()
        .into_inner();
    let err = collect(stream).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("only data and eof"),
        "{}",
        err.message()
    );
    let stream = ports
        .open(tokio_stream::iter(vec![
            open(port),
            data(&vec![0; (1 << 20) + 1]),
        ]))
        .await
        .unwrap()
        .into_inner();
    let err = collect(stream).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("at most 1048576 bytes"),
        "{}",
        err.message()
    );
    server.join().unwrap();
}
