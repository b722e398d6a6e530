"""Speculative decoding: a cheap guess of several tokens, checked by one forward of the target model.

sampling (the accept/resample rule, its exact output distribution, the batched verification kernel),
drafts (prompt-lookup n-gram drafts, an n-gram pool, and greedy speculative decoding on the tiny GPT),
medusa (extra heads on the frozen model, a candidate tree verified in one forward by tree attention),
eagle (a one-layer draft in the target's feature space; EAGLE-2's dynamic tree, EAGLE-3's training-time test),
mtp (multi-token prediction: parallel heads and DeepSeek-V3's sequential modules, reused as a draft),
osd (online speculative decoding: the draft distilled on the served traffic's target distributions),
dflash (a block drafter that proposes a whole block in one forward, then verification),
serving (drafters for the serving engine: EngineConfig(speculative=PromptLookup() or DraftModel(draft))).
"""
