"""The bottom layer every service shares: domain types and errors, the one codec between protobuf
and those types, adapter format and validation, checksums, and the store and worker clients.
Nothing here imports a service."""
