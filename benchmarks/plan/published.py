"""`ddpkit.plan` on paper: its scaling efficiency for published setups beside the published
figure, with everything the model had to assume printed. Nothing is measured here: the models'
parameter shapes are built on the meta device (ResNet-50/101 and VGG-16 as torchvision defines
them), the per-GPU compute comes from published single-GPU throughputs, the links are named.

    python benchmarks/plan/published.py
"""
import os
import sys

from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from ddpkit.cost.measure import workload_of  # noqa: E402
from ddpkit.plan.predict import predict  # noqa: E402
from ddpkit.cost.model import LINKS, Link  # noqa: E402

META = {"device": "meta"}


def _conv(cin, cout, k, bias=False):
    return [nn.Conv2d(cin, cout, k, bias=bias, **META)] + ([] if bias else
                                                           [nn.BatchNorm2d(cout, **META)])


def resnet(blocks):
    """torchvision's ResNet-50 ([3, 4, 6, 3]) / ResNet-101 ([3, 4, 23, 3]): bottlenecks, v1.5."""
    layers, cin = _conv(3, 64, 7), 64
    for stage, count in enumerate(blocks):
        planes = 64 * 2 ** stage
        for b in range(count):
            layers += _conv(cin, planes, 1) + _conv(planes, planes, 3) + _conv(planes, planes * 4, 1)
            if b == 0:
                layers += _conv(cin, planes * 4, 1)   # the downsample branch
            cin = planes * 4
    return nn.Sequential(*layers, nn.Linear(2048, 1000, **META))


def vgg16():
    cfg = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    layers, cin = [], 3
    for cout in cfg:
        layers += _conv(cin, cout, 3, bias=True)
        cin = cout
    return nn.Sequential(*layers, nn.Linear(25088, 4096, **META), nn.Linear(4096, 4096, **META),
                         nn.Linear(4096, 1000, **META))


PCIE = LINKS["100gbit"]                       # ~12 GB/s: PCIe 3.0 x16 between P100s
NVLINK = Link("nvlink", alpha=5e-6, beta=130e9)   # V100 NVLink: NCCL's measured bus bandwidth
ROCE25 = Link("25gbit RoCE", alpha=10e-6, beta=25e9 / 8 * 0.94)

#: (setup, model, per-GPU step seconds and where from, batch, nodes, GPUs a node, between,
#:  inside, published efficiency, source)
SETUPS = [
    ("Horovod, ResNet-101, 128 nodes x 4 P100", resnet([3, 4, 23, 3]),
     64 / 127, "127 img/s a P100, fp32 (assumed)", 64, 128, 4, LINKS["25gbit"], PCIE, 0.90,
     "Horovod docs (benchmarks): 90% at 512 GPUs, 25 Gbit/s RoCE"),
    ("  the same, alpha 10 us (RDMA, not TCP)", resnet([3, 4, 23, 3]),
     64 / 127, "as above", 64, 128, 4, ROCE25, PCIE, 0.90, "as above"),
    ("Horovod, VGG-16, 128 nodes x 4 P100", vgg16(),
     64 / 133, "133 img/s a P100, fp32 (assumed)", 64, 128, 4, LINKS["25gbit"], PCIE, 0.68,
     "Horovod docs (benchmarks): 68% at 512 GPUs"),
    ("  the same, alpha 10 us (RDMA, not TCP)", vgg16(),
     64 / 133, "as above", 64, 128, 4, ROCE25, PCIE, 0.68, "as above"),
    ("PyTorch DDP, ResNet-50, 2 nodes x 8 V100", resnet([3, 4, 6, 3]),
     32 / 360, "360 img/s a V100, fp32 (assumed)", 32, 2, 8, LINKS["100gbit"], NVLINK, 0.93,
     "issue 24: ~93% at 16 GPUs (PyTorch DDP paper, VLDB 2020)"),
]


def main():
    print(f"{'setup':<44} {'params':>7} {'published':>9} {'predicted':>9}  assumed")
    for name, model, compute, why, batch, nodes, per_node, link, inside, published, source \
            in SETUPS:
        work = workload_of(model, compute, batch, name)
        row = predict(work, [nodes], link, per_node=per_node, inside=inside, hooks=["none"])[0]
        print(f"{name:<44} {work.params / 1e6:>6.1f}M {published:>9.0%} {row.efficiency:>9.0%}  "
              f"step {compute * 1e3:.0f} ms ({why}); between nodes {link.name} "
              f"({link.beta / 1e9:.2f} GB/s, {link.alpha * 1e6:.0f} us); inside {inside.name}; "
              f"{nodes * per_node} ranks in one ring at the slower link; DDP's buckets "
              f"(25 MiB); source: {source}")


if __name__ == "__main__":
    main()
