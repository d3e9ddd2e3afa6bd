"""Triton kernels, each tested against its torch reference.

    paged_attention.py            decode and chunked-prefill attention over the page pool
    paged_attention_reference.py  its pure-torch reference (and the CPU path)
    store_kv.py                   a step's new K/V into their page slots (reference: index_copy_)
    elementwise.py                RMSNorm, rotary, SiLU-mul (reference: the model's own modules)
    draw_greedy.py                greedy picks + log-probs in one pass (reference: sampling/sampler.py)
    draw_sampled.py               filtered, seeded sampling without a sort (reference: sampling/sampler.py)
"""
