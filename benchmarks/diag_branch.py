"""Why BranchGRPO learns motion slowly on moving digits: measurements on the base policy (no training).

    PYTHONPATH=. .venv/bin/python benchmarks/diag_branch.py --json benchmarks/results/diag_branch.json  # ~1 min
    PYTHONPATH=. .venv/bin/python benchmarks/diag_branch.py --quick                                     # ~15 s
    PYTHONPATH=. .venv/bin/python benchmarks/diag_branch.py --config configs/digits_branch.yaml         # digits: the digit

Everything is measured on configs/moving_digits.yaml's base policy, sampler and rewards (issue 41):

(a) Where is the direction of motion decided? For s = 0..N-1 a tree per prompt shares its first s steps
    (a single split at step s into `--children` leaves; s = 0: only the initial noise is shared). The share
    of the motion outcome ("correct": the located digit moves the prompted way) that the shared prefix fixes
    is 1 - (mean within-tree variance) / (mean within-prompt variance of independent samples).
(b) One batch of trees with the BranchGRPO schedule (`--splits`, default the bench's 0, 2, 4, 6 x2) and the
    same prompts as flat groups of 16 independent samples: per step, the distinct trajectories per prompt,
    the spread of the node values (reward_sum, mean fusion) inside a tree and depth, the share of trees whose
    nodes at that depth differ in motion, the correlation of the trained advantage with motion, the kernel's
    std on the trained edges / transitions, and the norm of the policy gradient of that step's records
    (the trainer's normalisation: sum over records of -A * log p / all trained records).
JSON keys say "motion" for the attribute, whatever the world.
(c) The "motion-informative" records per prompt: trained records at a step whose motion outcome is still
    open (decided share of (a) below 0.9 before that step), whose advantage varies with motion in its group.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import repo_path, write_json  # noqa: E402

from difrl.algos.tree import tree_train_edges  # noqa: E402
from difrl.branching import BranchSchedule  # noqa: E402
from difrl.rollout import recompute, rollout  # noqa: E402
from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.flow.plan import step_masks  # noqa: E402
from difrl.train.reward_stage import build_rewards  # noqa: E402
from difrl.tree_rollout import tree_rollout  # noqa: E402
from difrl.utils.rng import mix_seed  # noqa: E402
from difrl.worlds import build_world  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "moving_digits.yaml"


def score(policy, rewards, x, prompts) -> dict[str, torch.Tensor]:
    """Every reward's scores [B] plus 'correct' (the motion reward's direction flag) of latents x."""
    videos = policy.decode(x)
    out = {}
    for name, fn in rewards.items():
        s = fn(videos, prompts)
        out[name] = s[name].float() if isinstance(s, dict) else s.float()
        if isinstance(s, dict) and "correct" in s and (name == "motion_direction" or "correct" not in out):
            out["correct"] = s["correct"].float()  # the attribute: motion direction if scored, else the reward's flag
    return out


def decided_share(policy, rewards, sigmas, kind, kw, prompts, seeds, children: int) -> list[float]:
    """(a): per shared-prefix length s, the share of the motion outcome's variance fixed by the prefix."""
    P = len(prompts)
    flat_seeds = torch.tensor([mix_seed(int(r), 99, c) for r in seeds for c in range(children)])
    fr = rollout(policy, [p for p in prompts for _ in range(children)], flat_seeds, sigmas, kind, kw)
    c = score(policy, rewards, fr.x_final, [p for p in prompts for _ in range(children)])["correct"].view(P, -1)
    ref = float(c.var(1).mean())
    out = []
    for s in range(len(sigmas) - 1):
        tr = tree_rollout(policy, prompts, seeds, sigmas, BranchSchedule((s,), children), kind, kw)
        c = score(policy, rewards, tr.x_leaf, [p for p in prompts for _ in range(children)])["correct"].view(P, -1)
        out.append(1.0 - float(c.var(1).mean()) / ref)
    return out


def grad_vector(policy, loss: torch.Tensor) -> torch.Tensor:
    """d loss / d theta over the policy network's parameters, flattened (fp32)."""
    params = [p for p in policy.module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).float().flatten() for p, g in zip(params, grads)])


def per_step_grads(policy, batch, adv_per_row: torch.Tensor, steps: torch.Tensor, kind, kw, total: int) -> dict:
    """d/dtheta [sum over the records of step i of -A log p / total] for each step i: {i: flat gradient}
    (batch rows [R, T]; `steps` [R] the step of each row when T = 1; for T > 1 every row holds every step)."""
    out = {}
    T = batch.step.shape[1]
    for i in sorted(set(steps.tolist())):
        rows = (steps == i).nonzero().flatten() if T == 1 else torch.arange(batch.step.shape[0])
        with torch.enable_grad():
            lp = recompute(policy, batch.select(rows), kind, kw).log_prob  # [R', T]
            sel = (batch.step[rows] == i).float()
            out[int(i)] = grad_vector(policy, -(adv_per_row[rows, None] * lp * sel).sum() / total)
    return out


def open_share(grads: dict, open_steps: list[int]) -> dict:
    """How much of the update's gradient comes from the steps where the attribute is still open: the norm of
    their summed gradient over the norm of the whole one, and the cosine between the two."""
    total = sum(grads.values())
    opened = sum(g for i, g in grads.items() if i in open_steps)
    if isinstance(opened, int):
        return {"norm_ratio": 0.0, "cosine": 0.0}
    return {"norm_ratio": float(opened.norm() / total.norm()),
            "cosine": float(torch.dot(opened, total) / (opened.norm() * total.norm() + 1e-30))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 prompts, 8 children in (a)")
    ap.add_argument("--config", type=Path, default=CONFIG, help="a flow config whose reward returns 'correct' (default "
                    "moving digits; configs/digits_branch.yaml: the digit's identity)")
    ap.add_argument("--json", type=Path, help="write the measurements here")
    ap.add_argument("--splits", type=int, nargs="*", default=[0, 2, 4, 6])
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--roots", type=int, default=1, help="trees per prompt (tree.roots)")
    ap.add_argument("--children", type=int, help="leaves per tree in (a) (default 16; --quick 8)")
    ap.add_argument("--reps", type=int, help="trees per prompt in (a) and groups per prompt in (b) (default 2; --quick 1)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. sampler.noise_level=0.7")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = load_flow_config(args.config, ["threads=1", *args.overrides])
    torch.set_num_threads(1)
    world = build_world(cfg.model.kind, cfg.model.path, cfg)
    policy = world.policy
    rewards, weights = build_rewards(cfg.reward, world.default_reward)
    N = cfg.sampler.num_steps
    sigmas = world.sigmas(N, cfg.sampler.shift)
    kind, kw = cfg.sampler.kind, cfg.sampler.kernel_kwargs()
    reps = args.reps or (1 if args.quick else 2)
    prompts_all = list(world.prompts)[: (10 if args.quick else len(world.prompts))]
    prompts = [p for p in prompts_all for _ in range(reps)]
    P = len(prompts)
    children = args.children or (8 if args.quick else 16)
    with torch.no_grad():
        decided = decided_share(policy, rewards, sigmas, kind, kw, prompts, torch.arange(P) * 7919 + 11, children)

    # (b) trees with the schedule vs flat groups of the same size, the same prompts
    sched = BranchSchedule(tuple(args.splits), args.factor)
    R = args.roots
    G = R * sched.leaves
    sde_mask, _, _ = step_masks(cfg, 0, P * G)
    cfg.tree.split_steps, cfg.tree.factor = list(args.splits), args.factor
    root_prompts = [p for p in prompts for _ in range(R)]
    with torch.no_grad():
        tr = tree_rollout(policy, root_prompts, torch.arange(P * R) * 104729 + 5, sigmas, sched, kind, kw,
                          cfg.tree.noise_scale, cfg.tree.kappa_logprob, sde_mask)
    leaf_prompts = [p for p in prompts for _ in range(G)]
    sc = score(policy, rewards, tr.x_leaf, leaf_prompts)
    keep = torch.ones(len(leaf_prompts), dtype=torch.bool)
    kept, adv_e, _ = tree_train_edges(tr, {k: sc[k] for k in weights}, weights, keep, 0, cfg.tree,
                                      cfg.reward.aggregate, cfg.advantage.eps, cfg.advantage.clip, roots=R)
    t = tr.tree
    from difrl.algos.tree import fuse_rewards  # node values of motion ("correct") and the summed reward

    motion_node = fuse_rewards(t, sc["correct"])
    edges = tr.edges.select(kept)
    child = t.edge_child[tr.trained_edge[kept]]
    e_step = t.edge_step[tr.trained_edge[kept]]
    e_group = t.tree[child] // R  # the prompt's group (a forest of R trees)
    tree_rows = {}
    for i in range(N):
        rows = (e_step == i).nonzero().flatten()
        if len(rows) == 0:
            continue
        key = e_group[rows]
        m = motion_node[child[rows]]
        a = adv_e[rows]
        groups = key.unique()
        varies = sum(float(m[key == g].max() - m[key == g].min() > 0) for g in groups) / len(groups)
        mc = torch.cat([m[key == g] - m[key == g].mean() for g in groups])
        ac = torch.cat([a[key == g] for g in groups])
        corr = float((mc * ac).sum() / (mc.norm() * ac.norm() + 1e-12))
        tree_rows[i] = {"records_per_prompt": len(rows) / P, "motion_varies_share": varies, "corr_adv_motion": corr,
                        "adv_abs_mean": float(a.abs().mean()), "std": float(edges.extras["std_old"][rows].mean())}
    gv_tree = per_step_grads(policy, edges, adv_e, e_step, kind, kw, len(kept))
    grads_tree = {i: float(g.norm()) for i, g in gv_tree.items()}

    # flat: G independent samples per prompt, the trainer's masks; advantage = group z-score of reward_sum
    _, train_mask, _ = step_masks(cfg, 0, P * G)
    with torch.no_grad():
        fr = rollout(policy, leaf_prompts, torch.arange(P * G) * 15485863 + 3, sigmas, kind, kw, sde_mask, train_mask)
    fs = score(policy, rewards, fr.x_final, leaf_prompts)
    r = sum(w * fs[k] for k, w in weights.items()).view(P, G)
    fa = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + cfg.advantage.eps)).flatten()
    fm = fs["correct"].view(P, G)
    f_varies = float(((fm.max(1).values - fm.min(1).values) > 0).float().mean())
    f_corr = float(((fm - fm.mean(1, keepdim=True)).flatten() * fa).sum()
                   / ((fm - fm.mean(1, keepdim=True)).norm() * fa.norm() + 1e-12))
    T = fr.step.shape[1]
    flat_rows = {}
    for j in range(T):
        i = int(fr.step[0, j])
        flat_rows[i] = {"records_per_prompt": G, "motion_varies_share": f_varies, "corr_adv_motion": f_corr,
                        "adv_abs_mean": float(fa.abs().mean())}
    with torch.no_grad():
        std_flat = recompute(policy, fr, kind, kw).std.view(-1, T)[0]
    for j in range(T):
        flat_rows[int(fr.step[0, j])]["std"] = float(std_flat[j])
    gv_flat = per_step_grads(policy, fr, fa, fr.step[0], kind, kw, P * G * T)  # the trainer's 1 / (B * T)
    grads_flat = {i: float(g.norm()) for i, g in gv_flat.items()}

    open_steps = [i for i in range(N) if decided[i] < 0.9]  # steps before which the outcome is less than 90% fixed
    informative_tree = sum(tree_rows[i]["records_per_prompt"] * tree_rows[i]["motion_varies_share"]
                           for i in open_steps if i in tree_rows)
    informative_flat = sum(flat_rows[i]["records_per_prompt"] * flat_rows[i]["motion_varies_share"]
                           for i in open_steps if i in flat_rows)
    grad_open = {"tree": open_share(gv_tree, open_steps), "flat": open_share(gv_flat, open_steps)}
    share_open = {k: sum(rows[i]["records_per_prompt"] for i in open_steps if i in rows)
                  / sum(r["records_per_prompt"] for r in rows.values()) for k, rows in (("tree", tree_rows), ("flat", flat_rows))}
    res = {"config": repo_path(args.config), "gradient_from_open_steps": grad_open, "share_of_records_at_open_steps": share_open, "overrides": args.overrides, "prompts": P, "splits": args.splits,
           "factor": args.factor, "roots": R, "decided_share_after_shared_steps": decided,
           "tree": tree_rows, "flat": flat_rows, "grad_norm_tree": grads_tree, "grad_norm_flat": grads_flat,
           "open_steps": open_steps, "motion_informative_records_per_prompt": {"tree": informative_tree,
                                                                               "flat": informative_flat},
           "tree_leaf_motion_accuracy": float(sc["correct"].mean()), "flat_motion_accuracy": float(fs["correct"].mean())}
    print(f"(a) share of the attribute's outcome ('correct': motion, or the digit) fixed by the first s steps (s = 0: the initial noise only), "
          f"{P} prompts x {children} continuations:")
    print("    " + "  ".join(f"s={s}: {d:.2f}" for s, d in enumerate(decided)))
    print(f"(b) per step, schedule splits {args.splits} x{args.factor}, {R} root(s) per prompt, vs flat {G} per prompt:")
    print("step | records/prompt tree / flat | attribute varies in group tree / flat | corr(A, attribute) tree / flat | "
          "|A| tree / flat | std tree / flat | grad norm tree / flat")
    for i in range(N):
        a, b = tree_rows.get(i), flat_rows.get(i)
        if a is None and b is None:
            continue
        f = lambda d, k, fmt: format(d[k], fmt) if d else "-"  # noqa: E731
        print(f"{i} | {f(a, 'records_per_prompt', '.0f')} / {f(b, 'records_per_prompt', '.0f')} | "
              f"{f(a, 'motion_varies_share', '.2f')} / {f(b, 'motion_varies_share', '.2f')} | "
              f"{f(a, 'corr_adv_motion', '.2f')} / {f(b, 'corr_adv_motion', '.2f')} | "
              f"{f(a, 'adv_abs_mean', '.2f')} / {f(b, 'adv_abs_mean', '.2f')} | {f(a, 'std', '.3f')} / {f(b, 'std', '.3f')} | "
              f"{grads_tree.get(i, float('nan')):.3g} / {grads_flat.get(i, float('nan')):.3g}")
    print(f"(c) steps with the attribute still open (less than 90% fixed before the step): {open_steps}; attribute-informative trained "
          f"records per prompt: tree {informative_tree:.1f}, flat {informative_flat:.1f}; share of the trained records at "
          f"those steps: tree {share_open['tree']:.2f}, flat {share_open['flat']:.2f}; their gradient's norm over the "
          f"whole update's: tree {grad_open['tree']['norm_ratio']:.3f}, flat {grad_open['flat']['norm_ratio']:.3f} "
          f"(cosine with it: tree {grad_open['tree']['cosine']:.3f}, flat {grad_open['flat']['cosine']:.3f})")
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
