"""What a GLM-5.3 checkpoint's files hold: safetensors headers, the rule of which tensors are servable
and which may be EXL3, and EXL3's storage names."""
