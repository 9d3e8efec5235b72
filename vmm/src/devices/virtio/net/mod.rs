//! virtio-net (not implemented yet).
pub struct Net;
impl Net {
    pub fn open(_tap: &str, _mac: [u8; 6]) -> std::io::Result<Box<dyn super::VirtioDevice>> {
        Err(std::io::Error::other(
            "virtio-net is not implemented in this build yet",
        ))
    }
}
