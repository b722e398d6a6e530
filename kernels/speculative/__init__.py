"""Speculative decoding: a cheap guess of several tokens, checked by one forward of the target model.

sampling (the accept/resample rule, its exact output distribution, the batched verification kernel),
drafts (prompt-lookup n-gram drafts, an n-gram pool, and greedy speculative decoding on the tiny GPT),
serving (drafters for the serving engine: EngineConfig(speculative=PromptLookup() or DraftModel(draft))).
"""
