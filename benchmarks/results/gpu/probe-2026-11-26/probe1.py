"""One-rank NCCL communicator: each usage error, announced before it runs."""
import sys, torch, torch.distributed as dist
import pycomm

def step(name, fn):
    print(f"probe: {name} ...", flush=True)
    try:
        fn()
        print(f"probe: {name}: no exception", flush=True)
    except BaseException as e:
        print(f"probe: {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)

check = len(sys.argv) > 1 and sys.argv[1] == "check"
comm = pycomm.init(rank=0, world_size=1, store=dist.HashStore(), transport="nccl",
                   device="cuda:0", set_default=False, key_prefix="p", check=check)
dev = comm.device
x = torch.ones(4, device=dev)
step("cpu tensor", lambda: comm.all_reduce(torch.ones(4)))
step("non-contiguous", lambda: comm.all_reduce(torch.ones(4, 2, device=dev).t()))
step("avg int", lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), op="avg"))
step("bogus algo", lambda: comm.all_reduce(x, algo="bogus"))
step("complex", lambda: comm.all_reduce(torch.ones(4, dtype=torch.complex64, device=dev)))
step("send self", lambda: comm.send(x, 0))
step("send 7", lambda: comm.send(x, 7))
step("broadcast 9", lambda: comm.broadcast(x, src=9))
step("reduce_scatter size", lambda: comm.reduce_scatter(torch.empty(3, device=dev), torch.ones(4, device=dev)))
step("direct", lambda: comm.all_reduce(x, algo="direct"))
step("irecv any", lambda: comm.irecv(x))
step("all_reduce ok", lambda: (comm.all_reduce(x), torch.cuda.synchronize(), print(x)))
step("barrier", lambda: comm.barrier())
step("close", lambda: comm.close())
print("probe: done", flush=True)
