"""Launch options every kit kernel passes: the arithmetic its bits and times were measured with,
whatever the installed Triton's defaults are.

enable_fp_fusion: Triton contracts a * b + c into one FMA (one rounding instead of two) unless told
not to, and Triton 3.9 warns that this default turns off in 3.10. The H200's measurements (linear's
row-count tiles and the split attention giving the prefill kernel's bits, every timing) were made
with FMAs, so each launch asks for them: an upgrade of Triton then does not silently change the
kernels' arithmetic.
"""
OPTIONS = {"enable_fp_fusion": True}
