//! dsec-api
