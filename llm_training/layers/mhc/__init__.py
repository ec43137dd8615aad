"""mHC, manifold-constrained hyper-connections (docs/model-spec.md §4.2): the module and its autograd Functions
(`hyper_connections`), the Sinkhorn projection (`sinkhorn`, with its Triton kernels `sinkhorn_kernels`), and the
fused stream backward kernels (`kernels`) behind their custom ops (`ops`)."""
