//! dsec-edge
