"""What ATOM holds after its post-load step: model dimensions, the parallel layout, naming profiles, the plan of
output tensors, the post-load rules per quant method, the format codecs (`codecs/`) and the per-architecture
rules (`arch/`). Imports only `files`."""
