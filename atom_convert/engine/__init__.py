"""The conversion itself: the driver (`convert`, `ensure_converted`), workers in threads or processes, the
readahead and the positional safetensors writer. Imports every floor below it."""
