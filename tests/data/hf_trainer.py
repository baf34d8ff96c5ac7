"""An HF Trainer script run with ``--deepspeed CONFIG``: a tiny Llama-architecture model from a random
``LlamaConfig`` (no download; ``--model t5``: a tiny T5 from a random ``T5Config``) trained on synthetic
tokens. Written for DeepSpeed; on the engine it runs
unchanged under ``torchrun ... -m engine.run tests/data/hf_trainer.py``.

    torchrun --standalone --nproc-per-node 2 tests/data/hf_trainer.py --deepspeed CFG --output_dir OUT \\
        --max_steps 6 --save_steps 3 [--resume_from_checkpoint OUT/checkpoint-3] --out losses.json

Rank 0 writes ``--out``: the implementation (``deepspeed.__version__``), the loss logged at every step
(``logging_steps=1``: the mean over ranks), each step's wall time, and, with ``--save-model DIR``,
``trainer.save_model(DIR)``'s time (the weights are checked by the test with ``from_pretrained``); with
``--eval``, the ``eval_loss`` logged every 3 steps (the model trained with gradient checkpointing) and a
greedy ``generate()`` of the trained model; with ``--freeze``, ``FROZEN``'s parameters are not trained.
"""

import argparse
import json
import time

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB, SEQ, USED = 64, 16, 8
FROZEN = "model.layers.0.self_attn"
"""``--freeze``: a part frozen as users freeze parts of a model (not the embeddings: under the Trainer's
reentrant gradient checkpointing, frozen embeddings leave every checkpointed layer without gradients)."""


class Tokens(torch.utils.data.Dataset):
    """``n`` sequences of tokens drawn uniformly from the first ``USED`` of ``VOCAB``: learnable (the best
    loss is ln 8 = 2.08, ln 64 = 4.16 at init), so six steps move the loss by far more than the tests'
    tolerance and a step that did not train would show (uniform tokens over the whole vocabulary cannot be
    learned: an untrained model's losses were within 1.3e-3 of trained ones)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, USED, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.step_s: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
        self.step_s.append(time.perf_counter() - self._t)

    def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    cfg = T5Config(  # type: ignore[call-arg]  # decoder_start_token_id: through PreTrainedConfig's kwargs
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(cfg)


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_steps", type=int, default=6)
    ap.add_argument("--save_steps", type=int, default=3)
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="per-device batch")
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--save-model", default=None)
    ap.add_argument("--model", choices=["llama", "t5"], default="llama")
    ap.add_argument(
        "--init-from", default=None, help="from_pretrained(DIR) under the ZeRO-3 zero.Init context"
    )
    ap.add_argument(
        "--eval",
        action="store_true",
        help="evaluate every 3 steps, gradient checkpointing, and a greedy generate() after training",
    )
    ap.add_argument("--freeze", action="store_true", help=f"train with {FROZEN} frozen (requires_grad False)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    evaluation: dict[str, object] = {}
    if a.eval:
        evaluation = {"eval_strategy": "steps", "eval_steps": 3, "per_device_eval_batch_size": 4}
        evaluation["gradient_checkpointing"] = True
    args = TrainingArguments(
        output_dir=a.output_dir,
        deepspeed=a.deepspeed,
        bf16=True,
        max_steps=a.max_steps,
        save_steps=a.save_steps,
        save_strategy="steps",
        logging_steps=1,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=1e-2,
        warmup_steps=2,
        weight_decay=3e-7,
        adam_beta1=0.8,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        seed=42,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        save_only_model=False,
        disable_tqdm=True,
        **evaluation,  # type: ignore[arg-type]
    )
    rec = Record()
    net: torch.nn.Module
    if a.model == "t5":
        net = t5()
    else:
        net = LlamaForCausalLM.from_pretrained(a.init_from) if a.init_from else model()
    if a.freeze:
        net.get_submodule(FROZEN).requires_grad_(False)
    held_out = Tokens(16) if a.eval else None
    trainer = Trainer(model=net, args=args, train_dataset=Tokens(64), eval_dataset=held_out, callbacks=[rec])
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    out: dict[str, object] = {"losses": rec.losses, "step_s": rec.step_s}
    if a.eval:
        out["eval_losses"] = {
            h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h
        }
        prompt = Tokens(2).x[:, :4]
        with torch.no_grad():  # every rank runs the same steps: synced_gpus (the ZeRO-3 gather is collective)
            gen = trainer.model.generate(
                input_ids=prompt, max_new_tokens=6, do_sample=False, synced_gpus=True
            )
        out["generate"] = {"prompt": prompt.tolist(), "tokens": gen.tolist()}
    if a.save_model:
        t0 = time.perf_counter()
        trainer.save_model(a.save_model)
        out["save_model_s"] = time.perf_counter() - t0
    import deepspeed

    out["deepspeed"] = deepspeed.__version__
    if trainer.is_world_process_zero():
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    # leave the process group before the interpreter exits: a gloo thread still running at exit aborted one
    # real DeepSpeed recording run ("terminate called without an active exception", SIGABRT)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
