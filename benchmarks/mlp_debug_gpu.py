import subprocess, sys, os
CASE = r'''
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from pallas_kernels.quantized_mlp import mosaic_gpu as mg
from tests.kernels.test_quantized_mlp import random_mlp, truth
d, f, mode, splits = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
orig = mg.plan
def plan(d, f, programs=132, splits=None):
    s, table = orig(d, f, programs, splits)
    gates = f // 64
    if mode == "gates":
        table = np.where(table >= gates, -1, table)
    return s, table
mg.plan = plan
args = random_mlp(np.random.default_rng(0), 8, d, f)
fn = jax.jit(lambda *a: mg.quantized_mlp(*a, splits=splits))
print("compiling", flush=True)
c = fn.lower(*args).compile()
print("compiled", flush=True)
out = jax.block_until_ready(c(*args))
want = truth(*args)
print("ran; rel err", float(np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)), flush=True)
'''
cases = [x.split(":") for x in sys.argv[1].split(";")]
for d, f, mode, s, dbg in cases:
    print(f"== d={d} f={f} {mode} splits={s} dbg={dbg}", flush=True)
    try:
        r = subprocess.run([sys.executable, "-c", CASE, d, f, mode, s], timeout=int(os.environ.get("T", 60)),
                           capture_output=True, text=True, env={**os.environ, "MLP_DBG": dbg})
        print(r.stdout[-300:], r.stderr[-600:] if r.returncode else "", flush=True)
    except subprocess.TimeoutExpired as e:
        print("TIMEOUT", (e.stdout or b"")[-200:], flush=True)
