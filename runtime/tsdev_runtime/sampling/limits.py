"""What one request may ask of the sampler (checked where requests come in, enforced where it samples)."""
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's and vLLM's default limit
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (OpenAI's limit)
