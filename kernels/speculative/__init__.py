"""Speculative decoding: a cheap guess of several tokens, checked by one forward of the target model.

sampling (the accept/resample rule, its exact output distribution, the batched verification kernel),
drafts (prompt-lookup n-gram drafts, an n-gram pool, and greedy speculative decoding on the tiny GPT),
medusa (extra heads on the frozen model, a candidate tree verified in one forward by tree attention),
serving (drafters for the serving engine: EngineConfig(speculative=PromptLookup() or DraftModel(draft))).
"""
