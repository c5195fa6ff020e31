"""Token choice, in one package: the request's sampling values and the logits pipeline
(`pipeline`: penalties, temperature, top-k/top-p/min-p, seeded uniforms, draws, logprobs), a
slot's sampling on the device (`sampler`: the values, uniforms and history in the slot's buffers),
the verifiers of a speculative round (`verifier`: greedy and rejection sampling), and the Triton
kernels beside those references (`triton_sample`: a row in one program; `triton_wide`: rows in
chunks; `triton_common`: the helpers both build on). Kernel modules load only where their kernels
run (they need triton).
"""
