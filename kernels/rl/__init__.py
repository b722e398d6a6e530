"""Reinforcement learning and preference tuning on the course's tiny GPT: token log-probs (logprobs),
the verifiable task (task), SFT (sft), GRPO (grpo), PPO (ppo, gae, ppo_run) and DPO and kin (preference)."""
