"""Train tiny reward models with one TRL version's own RewardTrainer, and record what TRL trained on.

    PYTHONPATH=.venv/trl-0.23 python tests/trl_train.py SPEC.json RESULT.json

Run by tests/test_trl_formats.py in a subprocess per TRL version (each version is a folder of its own first on
PYTHONPATH). SPEC: {"trl_version": "0.23.1", "cases": [{"name", "base_model", "out", "rows", "steps", ...}]}.
For each case: load the base model and its tokenizer, set the pad token as that TRL version's own example script
does (<= 0.23; later versions set it themselves), train with RewardTrainer, save with save_model, then record the
token ids TRL's preprocessing produced (its tokenized train dataset) and the scores TRL's own compute_loss gives the
trained model on them (collated by TRL's data collator, right-padded, as in training). Imports only TRL's stack.
"""

import json
import sys
import time


def _ids_columns(columns) -> tuple[str, str]:
    for pair in (
        ("input_ids_chosen", "input_ids_rejected"),
        ("chosen_input_ids", "rejected_input_ids"),
        ("chosen_ids", "rejected_ids"),
    ):  #  (<= 0.23, 0.24 to 0.29, >= 1.0)
        if pair[0] in columns:
            return pair
    raise KeyError(f"no tokenized columns in {columns}")


def train_case(case: dict, trl_version: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    started = time.perf_counter()
    old = tuple(int(x) for x in trl_version.split(".")[:2]) < (0, 24)
    tokenizer = AutoTokenizer.from_pretrained(case["base_model"])
    model = AutoModelForSequenceClassification.from_pretrained(case["base_model"], num_labels=1)
    if old:
        # TRL <= 0.23 needs a pad token from the user: its examples/scripts/reward_modeling.py aligns the model's with
        # the tokenizer's, and a tokenizer without one (Llama's) gets its EOS, as the TRL docs say.
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(case["seed"])
    args = RewardConfig(
        output_dir=case["out"] + "_run",
        max_steps=case["steps"],
        per_device_train_batch_size=case["batch"],
        learning_rate=case["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        seed=case["seed"],
        data_seed=case["seed"],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # RewardConfig turns it on; a tiny model only pays its recomputation
    )
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(case["rows"]), processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(case["out"])  # the model and the processing class (with the pad token it trained with)
    data = trainer.train_dataset
    chosen_col, rejected_col = _ids_columns(data.column_names)
    examples = [data[i] for i in range(len(data))]
    model = trainer.model.eval()
    chosen_scores, rejected_scores = [], []
    with torch.no_grad():
        for at in range(0, len(examples), 8):
            batch = trainer.data_collator(examples[at : at + 8])
            loss, out = trainer.compute_loss(model, batch, return_outputs=True)
            if isinstance(out, dict) and "rewards_chosen" in out:  # <= 0.23
                c, r = out["rewards_chosen"][:, 0], out["rewards_rejected"][:, 0]
            else:  # >= 0.24: chosen rows, then rejected rows
                c, r = torch.chunk(out.logits[:, 0], 2)
            chosen_scores += c.tolist()
            rejected_scores += r.tolist()
    return {
        "name": case["name"],
        "chosen_ids": [e[chosen_col] for e in examples],
        "rejected_ids": [e[rejected_col] for e in examples],
        "chosen_scores": chosen_scores,
        "rejected_scores": rejected_scores,
        "pad_token_id": model.config.pad_token_id,
        "seconds": time.perf_counter() - started,
    }


def main(spec_path: str, result_path: str) -> int:
    import datasets
    import torch
    import trl

    datasets.disable_progress_bars()
    # One thread: a tiny model's matmuls gain nothing from more, and the test machine's cores are shared.
    torch.set_num_threads(1)

    spec = json.loads(open(spec_path, encoding="utf-8").read())
    if trl.__version__ != spec["trl_version"]:
        raise SystemExit(f"TRL {trl.__version__} imported from {trl.__file__}, expected {spec['trl_version']}")
    results = [train_case(case, trl.__version__) for case in spec["cases"]]
    with open(result_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"trl_version": trl.__version__, "trl_file": trl.__file__, "cases": results}, f)
    import os

    os.replace(result_path + ".tmp", result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
