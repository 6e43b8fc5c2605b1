"""Building blocks of the models: linear layers and their quantisation methods, attention backends, rotary
embedding, norms and element-wise ops. Written against flat [num_tokens, ...] batches; they know nothing of
requests or scheduling."""
