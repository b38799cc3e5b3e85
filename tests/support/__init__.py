"""Test support: an independent gRPC stack (grpcio + protoc stubs) that plays the kubelet."""
