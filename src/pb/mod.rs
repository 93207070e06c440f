//! Generated protobuf and gRPC code for package `agq.v1`, and the encoded
//! file descriptor set that server reflection serves. The generated code
//! encodes with [`codec::Codec`].

#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("agq.v1");

pub mod codec;

/// Encoded `FileDescriptorSet` of every `agq.v1` proto, for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("agq_descriptor");
