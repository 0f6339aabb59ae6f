"""What many workers on many machines share: the storage (URL, masking, retries), the host and
study locks, and the hardware fingerprint that binds a study to one class of machine."""
