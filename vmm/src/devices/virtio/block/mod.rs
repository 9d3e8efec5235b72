//! virtio-blk (not implemented yet).
pub struct Block;
impl Block {
    pub fn open(
        _path: &std::path::Path,
        _ro: bool,
    ) -> std::io::Result<Box<dyn super::VirtioDevice>> {
        Err(std::io::Error::other(
            "virtio-blk is not implemented in this build yet",
        ))
    }
}
