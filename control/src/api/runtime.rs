//! Runtime calls (processes, files, sessions, ports), proxied to the node named by the
//! sandbox id. Streams stay streams: the first client message names the sandbox, the rest
//! (and the node's replies) are passed on as they come, so flow control reaches end to end.

use std::pin::Pin;
use std::sync::Arc;

use dsec_api::sandbox_id::SandboxId;
use dsec_api::v1::files_client::FilesClient;
use dsec_api::v1::files_server::Files;
use dsec_api::v1::network_client::NetworkClient;
use dsec_api::v1::ports_client::PortsClient;
use dsec_api::v1::ports_server::Ports;
use dsec_api::v1::process_client::ProcessClient;
use dsec_api::v1::process_server::Process;
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::sessions_client::SessionsClient;
use dsec_api::v1::sessions_server::Sessions;
use dsec_api::v1::*;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::Shared;
use crate::iam::Action;

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The first message of a client stream, or INVALID_ARGUMENT.
async fn first<T>(stream: &mut Streaming<T>, what: &str) -> Result<T, Status> {
    stream
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument(format!("the stream ended before its {what}")))
}

/// `first` followed by the rest of `inbound` (ending at the client's first error).
fn resend<T: Send + 'static>(first: T, inbound: Streaming<T>) -> impl Stream<Item = T> + Send {
    tokio_stream::once(first).chain(inbound.map_while(Result::ok))
}

/// A unary call on one sandbox, routed to its node. Written out as `async_trait` expands an
/// `async fn` (the attribute does not see inside macros).
macro_rules! unary {
    ($client:ident, $method:ident, $request:ty, $reply:ty, $action:expr) => {
        fn $method<'life0, 'async_trait>(
            &'life0 self,
            request: Request<$request>,
        ) -> Pin<
            Box<
                dyn std::future::Future<Output = Result<Response<$reply>, Status>>
                    + Send
                    + 'async_trait,
            >,
        >
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(async move {
                let (metadata, _, message) = request.into_parts();
                let route = self
                    .0
                    .route(&metadata, &message.sandbox_id, $action)
                    .await?;
                $client::new(route.channel)
                    .max_decoding_message_size(32 << 20)
                    .$method(message)
                    .await
            })
        }
    };
}

pub struct ProcessApi(pub Arc<Shared>);

#[tonic::async_trait]
impl Process for ProcessApi {
    type ExecStream = Boxed<ExecResponse>;

    async fn exec(
        &self,
        request: Request<Streaming<ExecRequest>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let (metadata, _, mut inbound) = request.into_parts();
        let start = first(&mut inbound, "start").await?;
        let id = match &start.kind {
            Some(exec_request::Kind::Start(s)) => s.sandbox_id.clone(),
            _ => {
                return Err(Status::invalid_argument(
                    "the first Exec message must be `start`",
                ))
            }
        };
        let route = self.0.route(&metadata, &id, Action::SandboxExec).await?;
        let replies = ProcessClient::new(route.channel)
            .max_decoding_message_size(32 << 20)
            .exec(resend(start, inbound))
            .await?
            .into_inner();
        Ok(Response::new(Box::pin(replies)))
    }
}

pub struct FilesApi(pub Arc<Shared>);

#[tonic::async_trait]
impl Files for FilesApi {
    type ReadStream = Boxed<FileChunk>;

    async fn read(
        &self,
        request: Request<ReadFileRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        let (metadata, _, message) = request.into_parts();
        let route = self
            .0
            .route(&metadata, &message.sandbox_id, Action::SandboxFiles)
            .await?;
        let chunks = FilesClient::new(route.channel)
            .max_decoding_message_size(32 << 20)
            .read(message)
            .await?
            .into_inner();
        Ok(Response::new(Box::pin(chunks)))
    }

    async fn write(
        &self,
        request: Request<Streaming<WriteFileRequest>>,
    ) -> Result<Response<WriteFileResponse>, Status> {
        let (metadata, _, mut inbound) = request.into_parts();
        let header = first(&mut inbound, "header").await?;
        let id = match &header.kind {
            Some(write_file_request::Kind::Header(h)) => h.sandbox_id.clone(),
            _ => {
                return Err(Status::invalid_argument(
                    "the first Write message must be the header",
                ))
            }
        };
        let route = self.0.route(&metadata, &id, Action::SandboxFiles).await?;
        FilesClient::new(route.channel)
            .write(resend(header, inbound))
            .await
    }

    unary!(
        FilesClient,
        list,
        ListDirRequest,
        ListDirResponse,
        Action::SandboxFiles
    );
    unary!(
        FilesClient,
        stat,
        StatRequest,
        FileInfo,
        Action::SandboxFiles
    );
    unary!(
        FilesClient,
        mkdir,
        MkdirRequest,
        MkdirResponse,
        Action::SandboxFiles
    );
    unary!(
        FilesClient,
        remove,
        RemoveRequest,
        RemoveResponse,
        Action::SandboxFiles
    );
    unary!(
        FilesClient,
        rename,
        RenameRequest,
        RenameResponse,
        Action::SandboxFiles
    );
}

pub struct SessionsApi(pub Arc<Shared>);

#[tonic::async_trait]
impl Sessions for SessionsApi {
    unary!(
        SessionsClient,
        create,
        CreateSessionRequest,
        SessionInfo,
        Action::SandboxExec
    );
    unary!(
        SessionsClient,
        run,
        RunInSessionRequest,
        CommandResult,
        Action::SandboxExec
    );
    unary!(
        SessionsClient,
        read_output,
        ReadOutputRequest,
        CommandResult,
        Action::SandboxExec
    );
    unary!(
        SessionsClient,
        close,
        CloseSessionRequest,
        CloseSessionResponse,
        Action::SandboxExec
    );
    unary!(
        SessionsClient,
        list,
        ListSessionsRequest,
        ListSessionsResponse,
        Action::SandboxGet
    );
}

pub struct PortsApi(pub Arc<Shared>);

#[tonic::async_trait]
impl Ports for PortsApi {
    type OpenStream = Boxed<PortResponse>;

    async fn open(
        &self,
        request: Request<Streaming<PortRequest>>,
    ) -> Result<Response<Self::OpenStream>, Status> {
        let (metadata, _, mut inbound) = request.into_parts();
        let mut open = first(&mut inbound, "open").await?;
        let Some(port_request::Kind::Open(target)) = &mut open.kind else {
            return Err(Status::invalid_argument(
                "the first Ports.Open message must be `open`",
            ));
        };
        let route = self
            .0
            .route(&metadata, &target.sandbox_id, Action::SandboxPorts)
            .await?;
        // The caller is authorized for the sandbox: the node's TCP API wants its port token.
        if target.access_token.is_empty() && target.sandbox_id.parse::<SandboxId>().is_ok() {
            target.access_token = SandboxesClient::new(route.channel.clone())
                .get(GetSandboxRequest {
                    sandbox_id: target.sandbox_id.clone(),
                })
                .await?
                .into_inner()
                .access_token;
        }
        let replies = PortsClient::new(route.channel)
            .max_decoding_message_size(2 << 20)
            .open(resend(open, inbound))
            .await?
            .into_inner();
        Ok(Response::new(Box::pin(replies)))
    }

    unary!(
        PortsClient,
        url,
        PortUrlRequest,
        PortUrl,
        Action::SandboxPorts
    );
    unary!(
        PortsClient,
        set_public,
        SetPortPublicRequest,
        SetPortPublicResponse,
        Action::SandboxPorts
    );
}

/// Network policies (`Network.SetNetworkPolicy`), routed to the sandbox's node.
pub struct NetworkApi(pub Arc<Shared>);

#[tonic::async_trait]
impl dsec_api::v1::network_server::Network for NetworkApi {
    unary!(
        NetworkClient,
        set_network_policy,
        SetNetworkPolicyRequest,
        Sandbox,
        Action::SandboxNetwork
    );
}
