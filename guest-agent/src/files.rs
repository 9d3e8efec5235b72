//! The Files service: streamed read and write with errors that name the path.

use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use dsec_api::agent::v1::files_server::Files;
use dsec_api::agent::v1::{
    write_file_request, FileChunk, FileInfo, FileType, ListDirRequest, ListDirResponse,
    MkdirRequest, MkdirResponse, ReadFileRequest, RemoveRequest, RemoveResponse, RenameRequest,
    RenameResponse, StatRequest, WriteFileRequest, WriteFileResponse,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const CHUNK_BYTES: usize = 64 * 1024;
const READ_QUEUE: usize = 4;

/// Serves `dsec.agent.v1.Files`.
pub struct FilesService;

/// Maps an I/O error on `path` to a gRPC status whose message names the path.
pub fn io_status(what: &str, path: &Path, err: &io::Error) -> Status {
    let path = path.display();
    match err.kind() {
        io::ErrorKind::NotFound => {
            Status::not_found(format!("{what} {path}: no such file or directory"))
        }
        io::ErrorKind::PermissionDenied => {
            Status::permission_denied(format!("{what} {path}: permission denied"))
        }
        io::ErrorKind::IsADirectory => {
            Status::invalid_argument(format!("{what} {path}: is a directory"))
        }
        io::ErrorKind::NotADirectory => Status::invalid_argument(format!(
            "{what} {path}: a parent component is not a directory"
        )),
        io::ErrorKind::AlreadyExists => {
            Status::already_exists(format!("{what} {path}: already exists"))
        }
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => {
            Status::resource_exhausted(format!(
                "{what} {path}: the sandbox's disk is full: free space, or create the sandbox with a larger disk"
            ))
        }
        io::ErrorKind::DirectoryNotEmpty => Status::failed_precondition(format!(
            "{what} {path}: directory not empty (remove with recursive)"
        )),
        _ => Status::internal(format!("{what} {path}: {err}")),
    }
}

/// Accepts only absolute paths without NUL bytes.
fn checked_path(path: &str) -> Result<PathBuf, Status> {
    if path.is_empty() {
        return Err(Status::invalid_argument("path is empty"));
    }
    if path.contains('\0') {
        return Err(Status::invalid_argument("path contains a NUL byte"));
    }
    if !path.starts_with('/') {
        return Err(Status::invalid_argument(format!(
            "path {path:?} is not absolute: give a path starting with '/'"
        )));
    }
    Ok(PathBuf::from(path))
}

fn file_info(name: String, meta: &std::fs::Metadata, path: &Path) -> FileInfo {
    use std::os::unix::fs::MetadataExt;
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        FileType::Symlink
    } else if ft.is_dir() {
        FileType::Dir
    } else if ft.is_file() {
        FileType::File
    } else {
        FileType::Other
    };
    let symlink_target = if ft.is_symlink() {
        std::fs::read_link(path)
            .map(|t| t.to_string_lossy().into_owned())
            .unwrap_or_default()
    } else {
        String::new()
    };
    FileInfo {
        name,
        r#type: kind as i32,
        size: meta.size(),
        mode: meta.mode(),
        mtime_unix_ms: meta.mtime() * 1000 + meta.mtime_nsec() / 1_000_000,
        symlink_target,
    }
}

/// Runs blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("file task failed: {e}")))?
}

#[tonic::async_trait]
impl Files for FilesService {
    async fn list_dir(
        &self,
        request: Request<ListDirRequest>,
    ) -> Result<Response<ListDirResponse>, Status> {
        let path = checked_path(&request.into_inner().path)?;
        blocking(move || {
            let entries = std::fs::read_dir(&path).map_err(|e| io_status("list", &path, &e))?;
            let mut out = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|e| io_status("list", &path, &e))?;
                let p = entry.path();
                // Entries may vanish while listing; skip those.
                if let Ok(meta) = std::fs::symlink_metadata(&p) {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    out.push(file_info(name, &meta, &p));
                }
            }
            out.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(ListDirResponse { entries: out })
        })
        .await
        .map(Response::new)
    }

    async fn stat(&self, request: Request<StatRequest>) -> Result<Response<FileInfo>, Status> {
        let path = checked_path(&request.into_inner().path)?;
        let meta = tokio::fs::symlink_metadata(&path)
            .await
            .map_err(|e| io_status("stat", &path, &e))?;
        Ok(Response::new(file_info(
            path.to_string_lossy().into_owned(),
            &meta,
            &path,
        )))
    }

    async fn mkdir(
        &self,
        request: Request<MkdirRequest>,
    ) -> Result<Response<MkdirResponse>, Status> {
        use std::os::unix::fs::DirBuilderExt;
        let request = request.into_inner();
        let path = checked_path(&request.path)?;
        let mode = if request.mode == 0 {
            0o755
        } else {
            request.mode & 0o7777
        };
        blocking(move || {
            std::fs::DirBuilder::new()
                .recursive(request.parents)
                .mode(mode)
                .create(&path)
                .map_err(|e| io_status("mkdir", &path, &e))
        })
        .await?;
        Ok(Response::new(MkdirResponse {}))
    }

    async fn remove(
        &self,
        request: Request<RemoveRequest>,
    ) -> Result<Response<RemoveResponse>, Status> {
        let request = request.into_inner();
        let path = checked_path(&request.path)?;
        if path == Path::new("/") {
            return Err(Status::invalid_argument("refusing to remove /"));
        }
        blocking(move || {
            let meta =
                std::fs::symlink_metadata(&path).map_err(|e| io_status("remove", &path, &e))?;
            let result = if !meta.is_dir() {
                std::fs::remove_file(&path)
            } else if request.recursive {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_dir(&path)
            };
            result.map_err(|e| io_status("remove", &path, &e))
        })
        .await?;
        Ok(Response::new(RemoveResponse {}))
    }

    async fn rename(
        &self,
        request: Request<RenameRequest>,
    ) -> Result<Response<RenameResponse>, Status> {
        let request = request.into_inner();
        let from = checked_path(&request.from)?;
        let to = checked_path(&request.to)?;
        tokio::fs::rename(&from, &to)
            .await
            .map_err(|e| io_status(&format!("rename to {}:", to.display()), &from, &e))?;
        Ok(Response::new(RenameResponse {}))
    }

    type ReadFileStream = ReceiverStream<Result<FileChunk, Status>>;

    async fn read_file(
        &self,
        request: Request<ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let path = checked_path(&request.into_inner().path)?;
        let mut file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| io_status("read", &path, &e))?;
        let meta = file
            .metadata()
            .await
            .map_err(|e| io_status("read", &path, &e))?;
        if meta.is_dir() {
            return Err(Status::invalid_argument(format!(
                "read {}: is a directory",
                path.display()
            )));
        }
        let (tx, rx) = mpsc::channel(READ_QUEUE);
        tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK_BYTES];
            loop {
                let message = match file.read(&mut buf).await {
                    Ok(0) => return,
                    Ok(n) => Ok(FileChunk {
                        data: buf[..n].to_vec(),
                    }),
                    Err(err) => Err(io_status("read", &path, &err)),
                };
                let failed = message.is_err();
                if tx.send(message).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn write_file(
        &self,
        request: Request<Streaming<WriteFileRequest>>,
    ) -> Result<Response<WriteFileResponse>, Status> {
        let mut inbound = request.into_inner();
        let header = match inbound.message().await? {
            Some(WriteFileRequest {
                kind: Some(write_file_request::Kind::Header(header)),
            }) => header,
            _ => {
                return Err(Status::invalid_argument(
                    "the first WriteFile message must be the header (path, mode)",
                ))
            }
        };
        let path = checked_path(&header.path)?;
        if header.create_parents {
            if let Some(parent) = path.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| io_status("create parent of", &path, &e))?;
            }
        }
        let mode = if header.mode == 0 {
            0o644
        } else {
            header.mode & 0o7777
        };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true).mode(mode);
        let mut file = tokio::fs::OpenOptions::from(options)
            .open(&path)
            .await
            .map_err(|e| io_status("write", &path, &e))?;
        let mut written = 0u64;
        while let Some(message) = inbound.message().await? {
            match message.kind {
                Some(write_file_request::Kind::Data(data)) => {
                    file.write_all(&data)
                        .await
                        .map_err(|e| io_status("write", &path, &e))?;
                    written += data.len() as u64;
                }
                _ => {
                    return Err(Status::invalid_argument(
                        "WriteFile: only data chunks may follow the header",
                    ))
                }
            }
        }
        file.flush()
            .await
            .map_err(|e| io_status("write", &path, &e))?;
        Ok(Response::new(WriteFileResponse {
            bytes_written: written,
        }))
    }
}
