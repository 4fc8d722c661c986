"""From a GGUF file to logits: the file (gguf_file, catalog), block formats (quants) and the CPU kernels (kernels,
qlinear), the transformer and its NextN head (transformer, mtp_head), the KV-cache context (batch, context) with its
compiled step (compiled, cuda_graphs), tensor-parallel shards (parallel/) and the sampler (sampling).

Imports only spec_cli.errors and spec_cli.options from outside the package."""
