"""MPS sharing's control daemons: the driver's ``nvidia-cuda-mps-control``, found under the driver
root and driven as NVIDIA's MPS control daemon drives it (:mod:`.control`), one daemon kept up per
shared resource (:mod:`.daemon`), the set following the store's plan (:mod:`.manager`)."""
