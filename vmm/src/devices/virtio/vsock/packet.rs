//! virtio-vsock packet header (virtio spec 5.10.6), little-endian on the wire.

use vm_memory::ByteValued;

pub const HEADER_SIZE: usize = 44;
/// Largest payload we accept from or give to the guest in one packet.
pub const MAX_PAYLOAD: usize = 64 * 1024;

pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flags: the sender will receive / send no more data.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

pub const HOST_CID: u64 = 2;

#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}
// SAFETY: packed plain-old-data, every bit pattern is valid.
unsafe impl ByteValued for Header {}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_SIZE);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_layout() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 0x1122_3344,
            dst_port: 5,
            len: 7,
            type_: TYPE_STREAM,
            op: OP_RW,
            flags: 0,
            buf_alloc: 9,
            fwd_cnt: 10,
        };
        let b = h.as_slice();
        assert_eq!(b.len(), HEADER_SIZE);
        assert_eq!(&b[16..20], &0x1122_3344u32.to_le_bytes());
        assert_eq!(&b[28..30], &1u16.to_le_bytes());
        assert_eq!(&b[30..32], &5u16.to_le_bytes());
        assert_eq!(&b[40..44], &10u32.to_le_bytes());
    }
}
