"""Generators of the generative methods, sized from the task's input shape (C_in, H, W). Every image generator ends
in Tanh: its output is read as pixels in [-1, 1] and mapped into the task's input space by
``generative_maths.to_input_space``. Layer widths are parameters (the seed-004 figures use small ones; see
configs/seed004_slaugfl/ and benchmarks/REPRODUCTION_seed004.md).

* :class:`ProtoGenerator` — SlaugFL scenario 2 (reference §5.4, after SlaugFL's acgan.py ``GAN_type=0``):
  one-hot(y) -> Linear(C, (ch/2) s^2) || noise -> Linear(nz, (ch/2) s^2), concatenated to ch x s x s (s = H/4)
  -> BN -> Conv3x3(ch, ch) -> BN -> LReLU -> Up x2 -> Conv3x3(ch, ch/2) -> BN -> LReLU -> Up x2 -> Conv3x3(ch/2, C_in)
  -> Tanh (resized to H x W when H is not a multiple of 4). The source uses ch = 128, nz = 100.
* :class:`ACGANGenerator` / :class:`ACGANDiscriminator` — SlaugFL scenario 1: the clvrai ACGAN layout (label
  embedding times noise, a linear layer, transposed convolutions with BN + ReLU, Tanh; a LeakyReLU/Dropout conv
  discriminator with a real/fake and a class head) cut to two up-/down-sampling stages for 28 x 28 inputs; the class
  head returns raw logits (the source applies Softmax before CrossEntropyLoss, reference §5.3 pitfall).
* :class:`FeatureGenerator` — FedGen: (noise, one-hot y) -> Linear -> BN -> ReLU -> Linear -> embedding (d).
* :class:`VirtualGenerator` — VHL: an *untrained* conv generator; class k's images come from latents around a
  class-specific random mean, so the virtual classes are distinct (the official VHL uses an untrained StyleGAN-v2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from algorithms import generative_maths
from raysim.shared_maths import class_prototypes
from raysim.training import OptimizerSpec, clone_state, make_optimizer


def _fit(x: torch.Tensor, hw: tuple) -> torch.Tensor:
    return x if tuple(x.shape[-2:]) == tuple(hw) else F.interpolate(x, size=hw, mode="bilinear", align_corners=False)


def _side(input_shape) -> int:
    return max(1, -(-int(input_shape[1]) // 4))


class ProtoGenerator(nn.Module):
    def __init__(self, num_classes: int, input_shape, channels: int = 128, noise_dim: int = 100):
        super().__init__()
        self.num_classes, self.noise_dim, self.hw = num_classes, noise_dim, tuple(input_shape[1:])
        self.s, half = _side(input_shape), channels // 2
        self.ch = 2 * half
        self.label_fc = nn.Linear(num_classes, half * self.s * self.s)
        self.noise_fc = nn.Linear(noise_dim, half * self.s * self.s)
        self.net = nn.Sequential(
            nn.BatchNorm2d(self.ch), nn.Conv2d(self.ch, self.ch, 3, 1, 1), nn.BatchNorm2d(self.ch), nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2), nn.Conv2d(self.ch, half, 3, 1, 1), nn.BatchNorm2d(half), nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2), nn.Conv2d(half, int(input_shape[0]), 3, 1, 1), nn.Tanh())

    def forward(self, noise: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(y, self.num_classes).to(noise.dtype)
        h = torch.cat([self.label_fc(onehot), self.noise_fc(noise)], dim=1).view(-1, self.ch, self.s, self.s)
        return _fit(self.net(h), self.hw)


class ACGANGenerator(nn.Module):
    def __init__(self, num_classes: int, input_shape, channels: int = 64, noise_dim: int = 110):
        super().__init__()
        self.num_classes, self.noise_dim, self.hw = num_classes, noise_dim, tuple(input_shape[1:])
        self.s, self.ch = _side(input_shape), channels
        self.embed = nn.Embedding(num_classes, noise_dim)
        self.fc = nn.Linear(noise_dim, 2 * channels * self.s * self.s)
        self.net = nn.Sequential(
            nn.BatchNorm2d(2 * channels), nn.ReLU(True),
            nn.ConvTranspose2d(2 * channels, channels, 4, 2, 1), nn.BatchNorm2d(channels), nn.ReLU(True),
            nn.ConvTranspose2d(channels, int(input_shape[0]), 4, 2, 1), nn.Tanh())
        init_normal(self)

    def forward(self, noise: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.embed(y) * noise).view(-1, 2 * self.ch, self.s, self.s)
        return _fit(self.net(h), self.hw)


class ACGANDiscriminator(nn.Module):
    def __init__(self, num_classes: int, input_shape, channels: int = 32):
        super().__init__()
        self.hw = (4 * _side(input_shape),) * 2
        self.net = nn.Sequential(
            nn.Conv2d(int(input_shape[0]), channels, 3, 2, 1), nn.LeakyReLU(0.2), nn.Dropout(0.5),
            nn.Conv2d(channels, 2 * channels, 3, 2, 1), nn.BatchNorm2d(2 * channels), nn.LeakyReLU(0.2), nn.Dropout(0.5),
            nn.Flatten())
        flat = 2 * channels * _side(input_shape) ** 2
        self.adv = nn.Linear(flat, 1)  # a logit: BCE-with-logits (the source's Sigmoid + BCELoss)
        self.aux = nn.Linear(flat, num_classes)  # raw class logits + CE
        init_normal(self)

    def forward(self, x: torch.Tensor):
        h = self.net(_fit(x, self.hw))
        return self.adv(h).squeeze(1), self.aux(h)


def init_normal(module: nn.Module) -> None:
    """N(0, 0.02) conv weights, N(1, 0.02) BN weights, zero BN bias (clvrai ACGAN / DCGAN init)."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


class FeatureGenerator(nn.Module):
    def __init__(self, num_classes: int, embed_dim: int, hidden: int = 256, noise_dim: int = 32):
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.net = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Linear(hidden, embed_dim))

    def forward(self, noise: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([noise, F.one_hot(y, self.num_classes).to(noise.dtype)], dim=1))


class VirtualGenerator(nn.Module):
    def __init__(self, num_classes: int, input_shape, channels: int = 32, noise_dim: int = 64):
        super().__init__()
        self.noise_dim, self.hw = noise_dim, tuple(input_shape[1:])
        self.s, self.ch = _side(input_shape), channels
        self.class_means = nn.Parameter(torch.randn(num_classes, noise_dim), requires_grad=False)
        self.fc = nn.Linear(noise_dim, channels * self.s * self.s)
        self.net = nn.Sequential(nn.LeakyReLU(0.2), nn.Upsample(scale_factor=2), nn.Conv2d(channels, channels, 3, 1, 1),
                                 nn.LeakyReLU(0.2), nn.Upsample(scale_factor=2),
                                 nn.Conv2d(channels, int(input_shape[0]), 3, 1, 1), nn.Tanh())

    @torch.no_grad()
    def forward(self, noise: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.class_means[y] + 0.5 * noise).view(-1, self.ch, self.s, self.s)
        return _fit(self.net(h), self.hw)


# ---------------------------------------------------------------------------------------------------------------
# SlaugFL's generator training (reference §5.3, §5.4): plain functions of the generator, its training data, the
# method's Params (gen_steps, gen_batch, gen_lr, and gen_noise / lam_div or gan_noise) and an explicit torch generator


@dataclass(frozen=True)
class GeneratorRun:
    """How a generator trains: the method's Params (gen_steps, gen_batch, gen_lr, gen_noise / lam_div or gan_noise),
    the explicit torch generator of its draws, and the task's pixel normalisation (None: outputs used as they are)."""
    params: Any
    generator: torch.Generator
    norm: Optional[tuple] = None


LAST = 10  # the reported generator losses: their mean over the last LAST steps


def train_proto_generator(gen: ProtoGenerator, protos: torch.Tensor, mask: torch.Tensor, embed,
                          run: GeneratorRun) -> tuple[dict, dict]:
    """Scenario 2: ``p.gen_steps`` Adam(0.5, 0.999) steps of the prototype-guided generator. Per batch of labels y
    drawn among the classes with a prototype (``mask``) and noise z: L_proto = MSE(per-label mean of
    ``embed(x, y)``, protos[those labels]), x = G(z, y) in the task's input space (``norm``), plus the mode-seeking
    diversity loss lam_div / (l_z + 1e-5). ``embed(x, y)``: the embeddings of x, each under the representative model
    of its label. Returns (the generator's weights, the losses' means over the last 10 steps, or all when fewer)."""
    p, g, norm = run.params, run.generator, run.norm
    device = protos.device
    classes = torch.nonzero(mask, as_tuple=False).flatten().to(device)
    opt = make_optimizer(gen.parameters(), OptimizerSpec("adam", p.gen_lr, betas=(0.5, 0.999)))
    gen.train()
    lp = ld = 0.0
    for step in range(p.gen_steps):
        y = classes[torch.randint(len(classes), (p.gen_batch,), generator=g, device=device)]
        z = torch.randn(p.gen_batch, p.gen_noise, generator=g, device=device)
        raw = gen(z, y)
        present, means, _ = class_prototypes(embed(generative_maths.to_input_space(raw, norm), y), y, protos.shape[0])
        l_proto = F.mse_loss(means, protos[present])
        l_div = generative_maths.diversity_loss(raw, z, p.lam_div)
        opt.zero_grad(set_to_none=True)
        (l_proto + l_div).backward()
        opt.step()
        if step >= p.gen_steps - LAST:  # mean over the last LAST steps (all of them when there are fewer)
            n = min(LAST, p.gen_steps)
            lp, ld = lp + float(l_proto.detach()) / n, ld + float(l_div.detach()) / n
    return clone_state(gen), {"gen_proto_loss": lp, "gen_div_loss": ld, "gen_steps": float(p.gen_steps)}


def train_acgan(gen: ACGANGenerator, disc: ACGANDiscriminator, x: torch.Tensor, y: torch.Tensor,
                run: GeneratorRun) -> tuple[dict, dict]:
    """Scenario 1: ``p.gen_steps`` alternating Adam(0.5, 0.999) steps of an ACGAN on the labelled data (x, y) (the
    filtered candidates, in the task's input space): the discriminator on a real batch and a generated one of
    labels drawn among y's classes (0.5 x the mean of the real and fake (BCE + CE) terms), then the generator
    (0.5 x (BCE + CE) of its batch judged real). Returns (the generator's weights, the losses' means over the last
    10 steps)."""
    p, g, norm = run.params, run.generator, run.norm
    device = x.device
    opt_g = make_optimizer(gen.parameters(), OptimizerSpec("adam", p.gen_lr, betas=(0.5, 0.999)))
    opt_d = make_optimizer(disc.parameters(), OptimizerSpec("adam", p.gen_lr, betas=(0.5, 0.999)))
    classes = torch.unique(y)
    gen.train()
    disc.train()
    bce = F.binary_cross_entropy_with_logits
    ld_sum = lg_sum = 0.0
    for step in range(p.gen_steps):
        b = min(p.gen_batch, len(y))
        idx = torch.randint(len(y), (b,), generator=g, device=device)
        xr, yr = x[idx], y[idx]
        z = torch.randn(b, p.gan_noise, generator=g, device=device)
        yg = classes[torch.randint(len(classes), (b,), generator=g, device=device)]
        fake = generative_maths.to_input_space(gen(z, yg), norm)
        ones, zeros = torch.ones(b, device=device), torch.zeros(b, device=device)
        adv_r, aux_r = disc(xr)
        adv_f, aux_f = disc(fake.detach())
        l_d = 0.5 * (0.5 * (bce(adv_r, ones) + F.cross_entropy(aux_r, yr))
                     + 0.5 * (bce(adv_f, zeros) + F.cross_entropy(aux_f, yg)))
        opt_d.zero_grad(set_to_none=True)
        l_d.backward()
        opt_d.step()
        adv_g, aux_g = disc(fake)
        l_g = 0.5 * (bce(adv_g, ones) + F.cross_entropy(aux_g, yg))
        opt_g.zero_grad(set_to_none=True)
        l_g.backward()
        opt_g.step()
        if step >= p.gen_steps - LAST:
            n = min(LAST, p.gen_steps)
            ld_sum, lg_sum = ld_sum + float(l_d.detach()) / n, lg_sum + float(l_g.detach()) / n
    return clone_state(gen), {"gan_d_loss": ld_sum, "gan_g_loss": lg_sum, "gen_steps": float(p.gen_steps)}
