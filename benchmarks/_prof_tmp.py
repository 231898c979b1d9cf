import torch, json, sys, time
from longqa.bench import random_model
from longqa.config import load_config
from longqa.train.actor import Actor, Samples
dev = torch.device("cuda")
model = random_model("qwen3-1.7b", dev)
P, R, n = 8192, 1024, 8
g = torch.Generator().manual_seed(0)
V = model.config.vocab_size
prompt = torch.randint(0, V, (P,), generator=g).tolist()
resp = [torch.randint(0, V, (R,), generator=g).tolist() for _ in range(n)]
samples = Samples([prompt]*n, resp, torch.ones(n), n)
cfg = load_config(None, ["actor.shared_prompt=true", f"actor.max_tokens_per_micro_batch={P+n*R}", f"rollout.n={n}", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"])
actor = Actor(model, cfg, 1, dev)
def step():
    for micro in actor.micro_batches(samples, list(range(n))):
        logp, _, mask = actor.forward(model, micro)
        (logp * mask).sum().backward()
    model.zero_grad(set_to_none=True)
step(); step(); torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    step(); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
