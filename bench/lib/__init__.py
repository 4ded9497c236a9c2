"""What the benches share; each bench is a script that imports from here, never from another bench.

    meta         the header every result carries (commit, device, versions, settings), summaries, JSON
    timing       GPU time of kernel-sized calls (CUDA graphs), one call timed (CUDA events or wall time)
    checkpoints  the tiny checkpoint, checkpoints at GLM-5.3's layer dimensions, a model run deeper
    decode       a timed greedy decode and the options of the CUDA-graph benches
    kvstate      an empty KV cache with GLM-5.3's row sizes
    pagecache    evicting cache files from the OS page cache
    exllamav3    exllamav3 side by side, through the GPU tests' wrapper
    log          progress lines on stderr

Run a bench from the repository root as a module, `python -m bench.bench_prefix_cache --help`
(or as `python bench/bench_prefix_cache.py` where the kit is installed, as ./setup.sh does).
"""
