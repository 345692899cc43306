"""The mutations :mod:`run_mutations` applies: each a promise the README, docs/ or a module
docstring makes, broken by a one-line change to ``src/``, with the fewest, fastest tests that must
notice. A feature lands with its mutation: append a :class:`Mutation` here in the same commit
(run ``python tests/mutation/run_mutations.py --only NAME`` to see it caught)."""

from __future__ import annotations

import dataclasses

RESUME = "tests/integration/test_resume_exact.py::test_a_stopped_and_resumed_run_with_dropout_augmentation_and_accumulation_equals_the_unstopped_one"
ASYNC = "tests/integration/test_resume_exact.py::test_each_background_checkpoint_holds_its_own_steps_weights_while_writes_overlap_training"
EPOCHS = "tests/integration/test_epochs_order.py"
SCHEDULE = "tests/unit/test_schedule_shape.py"
WINDOW = "tests/unit/test_throughput_window.py"
GRAPHS = "tests/unit/test_graphs.py"
CHOOSE = "tests/unit/test_choose.py"
BEST = "tests/unit/test_best_hooks.py"
KEYS = f"{CHOOSE}::test_the_cache_keys_of_choose_and_of_the_compile_warm_start_include_the_device_name"
FINAL_PASS = f"{BEST}::test_a_final_validation_pass_at_a_stop_between_evaluations_that_is_the_best_is_kept"
TRACKERS = "tests/integration/test_trackers.py::test_a_resumed_run_continues_the_same_wandb_and_mlflow_runs_with_their_whole_history"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One behaviour broken by one line: in ``path``, ``original`` (a whole line, indentation
    included, present exactly once) becomes ``mutated``; ``tests`` are the pytest node ids that
    must fail."""

    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    why: str


MUTATIONS: tuple[Mutation, ...] = (
    # --- exact resume with randomness (issue 31) --------------------------------------------------
    Mutation(
        "rng-torch",
        "src/turbotrain/base/seeds.py",
        '    torch.set_rng_state(state["torch"])',
        "    pass  # mutation: torch's generator not restored",
        (RESUME,),
        "a resume leaves torch's generator (dropout) where the new process put it",
    ),
    Mutation(
        "rng-python",
        "src/turbotrain/base/seeds.py",
        '    random.setstate(_as_tuple(state["python"]))',
        "    pass  # mutation: Python's generator not restored",
        (RESUME,),
        "a resume leaves Python's random where the new process put it",
    ),
    Mutation(
        "rng-numpy",
        "src/turbotrain/base/seeds.py",
        "    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))",
        "    pass  # mutation: numpy's generator not restored",
        (RESUME,),
        "a resume leaves numpy's generator where the new process put it",
    ),
    Mutation(
        "rng-drawn-after-restore",
        "src/turbotrain/app/training.py",
        "    set_rng_state(first_step_draws)",
        "    pass  # mutation: the FLOP count's draws stay in the restored generators",
        (RESUME,),
        "the FLOP count's forward (dropout) draws from the generators a resume just restored",
    ),
    Mutation(
        "run-seeds-torch-only",
        "src/turbotrain/app/prepare.py",
        "    seed_all(config.run.seed)  # torch, random and numpy: a user's model or loss may draw from any of them",
        "    torch.manual_seed(config.run.seed)  # mutation: random and numpy left unseeded",
        (RESUME,),
        "Python's random and numpy unseeded: two runs with one seed differ",
    ),
    Mutation(
        "worker-stream-not-per-batch",
        "src/turbotrain/parts/data/epochs.py",
        "        if isinstance(batch, Indices) and torch.utils.data.get_worker_info() is not None:",
        "        if False:  # mutation: a worker's augmentation draws from its own stream",
        (RESUME,),
        "an augmentation in a DataLoader worker restarts its stream at a resume",
    ),
    Mutation(
        "resume-ignores-accumulation",
        "src/turbotrain/parts/models/spec.py",
        "        return step * c.batch.accumulation",
        "        return step  # mutation: the data position forgets accumulation",
        (RESUME,),
        "a resume with accumulation re-reads micro-batches already trained on",
    ),
    Mutation(
        "async-staged-before-previous-write-ends",
        "src/turbotrain/loop/checkpoint/__init__.py",
        "            self._finished(ctx, self.background.wait())  # the previous write first (its failure raised here)",
        "            pass  # mutation: the next checkpoint is staged while the previous one is written",
        (ASYNC,),
        "a background checkpoint holds a later step's weights",
    ),
    # --- data order --------------------------------------------------------------------------------
    Mutation(
        "loader-shuffle-ignored",
        "src/turbotrain/parts/data/epochs.py",
        "    sampler = EpochSampler(len(dataset), batch_size, seed, shuffles(loader), at)  # type: ignore[arg-type]",
        "    sampler = EpochSampler(len(dataset), batch_size, seed, False, at)  # type: ignore[arg-type]",
        (EPOCHS,),
        "a --model loader with shuffle=True trains in the dataset's order",
    ),
    Mutation(
        "partial-last-batch-kept",
        "src/turbotrain/parts/data/epochs.py",
        "        self.steps_per_epoch = size // self.global_batch",
        "        self.steps_per_epoch = -(-size // self.global_batch)  # mutation: a partial last batch per epoch",
        (
            f"{EPOCHS}::test_an_epochs_run_trains_each_epochs_order_row_by_row_and_drops_the_partial_batch[in_order-False-6]",
        ),
        "each epoch ends with a short batch the docs say is dropped",
    ),
    # --- schedule ----------------------------------------------------------------------------------
    Mutation(
        "cosine-becomes-linear",
        "src/turbotrain/core/optim.py",
        '        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress',
        "        shape = 1.0 - progress  # mutation: every decay linear",
        (SCHEDULE,),
        "cosine decay is linear",
    ),
    Mutation(
        "warmup-off-by-one",
        "src/turbotrain/core/optim.py",
        "    return (s + 1) / warmup_steps if s < warmup_steps else 1.0",
        "    return s / warmup_steps if s < warmup_steps else 1.0  # mutation: the first step at LR 0",
        (SCHEDULE,),
        "the warmup starts at 0 and ends a step late",
    ),
    # --- throughput --------------------------------------------------------------------------------
    Mutation(
        "samples-per-s-from-run-totals",
        "src/turbotrain/loop/monitor/hook.py",
        '            record["samples_per_s"] = self.world * (samples - last_samples) / dt',
        '            record["samples_per_s"] = self.world * samples / dt  # mutation: all samples over the window',
        (WINDOW,),
        "samples/s (so TFLOP/s, MFU) from the run's total samples",
    ),
    Mutation(
        "tokens-per-s-from-run-totals",
        "src/turbotrain/loop/monitor/hook.py",
        '            record["tokens_per_s"] = self.world * (tokens - last_tokens) / dt',
        '            record["tokens_per_s"] = self.world * tokens / dt  # mutation: all tokens over the window',
        (WINDOW,),
        "tokens/s (so TFLOP/s, MFU) from the run's total tokens",
    ),
    Mutation(
        "window-time-from-run-start",
        "src/turbotrain/loop/monitor/hook.py",
        "        dt = now - t - (side_s - self._side_s)  # evaluation and checkpoint time are not training",
        "        dt = now - self._t0 - side_s  # mutation: the time since the start",
        (WINDOW,),
        "throughput over the time since the start, not the window",
    ),
    Mutation(
        "window-counts-evaluation-time",
        "src/turbotrain/loop/monitor/hook.py",
        "        dt = now - t - (side_s - self._side_s)  # evaluation and checkpoint time are not training",
        "        dt = now - t  # mutation: evaluation and checkpoint time counted as training",
        (WINDOW,),
        "evaluation time lowers the training throughput",
    ),
    # --- behaviours the suite caught before (issue 31's audit) -------------------------------------
    Mutation(
        "accumulation-not-divided",
        "src/turbotrain/core/window.py",
        "        scaled = loss / self.accumulation if self.accumulation > 1 else loss",
        "        scaled = loss  # mutation: accumulated gradients k times too large",
        ("tests/unit/test_engine.py::test_k_accumulated_micro_batches_equal_one_k_times_batch",),
        "k accumulated micro-batches sum their gradients instead of averaging",
    ),
    Mutation(
        "fallback-threshold-off-by-one",
        "src/turbotrain/core/nonfinite.py",
        '        if self.mode == "skip" or new < self.max_steps:',
        '        if self.mode == "skip" or new <= self.max_steps:  # mutation',
        ("tests/unit/test_engine.py::test_non_finite_loss_is_skipped_then_falls_back",),
        "the precision fallback comes one non-finite step late",
    ),
    Mutation(
        "checksum-not-compared",
        "src/turbotrain/loop/checkpoint/format.py",
        '    return "" if actual == expected else f"{path.name} does not match its checksum (truncated or corrupt)"',
        '    return "" if True else f"{path.name} does not match its checksum (truncated or corrupt)"  # mutation',
        (
            "tests/unit/test_checkpoint.py::test_corrupt_newest_falls_back_to_the_previous",
            "tests/unit/test_checkpoint.py::test_damaged_checksum_files_and_foreign_payloads_fall_back",
        ),
        "a corrupt checkpoint loads as if it verified",
    ),
    Mutation(
        "finder-without-headroom",
        "src/turbotrain/tools/memory/finder.py",
        "    target = None if limit is None else limit / (1.0 + headroom)  # None: no memory limit was met",
        "    target = None if limit is None else limit  # mutation: no headroom kept",
        (
            "tests/unit/test_memory.py::test_finder_returns_a_size_within_the_headroom_below_the_limit_in_few_trials",
            "tests/unit/test_memory.py::test_finder_never_exceeds_a_memory_cap_and_keeps_headroom_under_it",
        ),
        "the batch-size finder picks a size at the memory limit",
    ),
    Mutation(
        "ddp-always-syncs",
        "src/turbotrain/core/distributed.py",
        "        cast(DistributedDataParallel, model).require_backward_grad_sync = sync",
        "        cast(DistributedDataParallel, model).require_backward_grad_sync = True  # mutation: no no_sync under accumulation",
        (
            "tests/distributed/test_data_parallel.py::test_ddp_accumulation_reduces_gradients_once_per_optimizer_step",
        ),
        "DDP all-reduces at every micro-batch under accumulation",
    ),
    Mutation(
        "errors-print-a-traceback",
        "src/turbotrain/cli/__init__.py",
        '        print(f"turbotrain {name}: error: {exc}", file=sys.stderr)',
        '        __import__("traceback").print_exc(); print(f"turbotrain {name}: error: {exc}", file=sys.stderr)  # mutation',
        (
            "tests/integration/test_train_model.py::test_model_and_resume_together_is_one_line",
            "tests/integration/test_train_cli.py::test_resume_mistakes_give_one_line_errors_and_lose_nothing",
        ),
        "a user's mistake prints a traceback besides its one line",
    ),
    Mutation(
        "scheduler-state-not-saved",
        "src/turbotrain/loop/checkpoint/state.py",
        '        entries["scheduler"] = scheduler',
        "        pass  # mutation: the LR schedule restarts at a resume",
        (RESUME, "tests/integration/test_train_cli.py::test_stop_and_resume_equals_an_uninterrupted_run"),
        "a resumed run restarts the LR schedule (warmup again)",
    ),
    # --- issue 45: the promises of the features added in the round before it ----------------------
    Mutation(
        "oom-parts-weighted-equally",
        "src/turbotrain/core/window.py",
        "        micro.extend((part, batch_size(part) / n * split) for part in split_batch(batch, split))",
        "        micro.extend((part, 1.0) for part in split_batch(batch, split))  # mutation: equal weights",
        (
            "tests/unit/test_window.py::test_after_an_oom_halving_unequal_parts_are_weighted_by_their_share_so_the_step_is_the_whole_batchs",
        ),
        "after an OOM halving, a 3-row and a 2-row part count alike: the step is not the whole batch's",
    ),
    Mutation(
        "window-syncs-every-micro-batch",
        "src/turbotrain/core/window.py",
        "        sync = self.pending % self.accumulation + 1 == self.accumulation",
        "        sync = True  # mutation: gradients reduced at every micro-batch",
        (
            "tests/unit/test_window.py::test_the_window_runs_its_micro_batches_with_gradient_sync_before_the_last_only",
        ),
        "on the fit path gradients are reduced across ranks in every micro-batch's backward",
    ),
    Mutation(
        "worker-seed-from-the-ranks-own-count",
        "src/turbotrain/parts/data/epochs.py",
        "            yield Indices(self.batch(k), derive_seed(self.seed, *self.at.slot(k)))",
        "            yield Indices(self.batch(k), derive_seed(self.seed, *divmod(k, self.at.accumulation)))  # mutation: the rank's own count",
        ("tests/unit/test_data.py::test_each_micro_batch_of_a_step_gets_its_own_worker_seed_on_every_rank",),
        "the ranks' data workers draw the same augmentation for their micro-batches of a step",
    ),
    Mutation(
        "graph-loss-not-copied-out",
        "src/turbotrain/core/graphs.py",
        "        return loss_sum.clone(), (norm.clone() if norm is not None else None)",
        "        return loss_sum, norm  # mutation: the graph's output tensors themselves",
        (f"{GRAPHS}::test_each_replays_loss_is_copied_out_before_the_next_replay_overwrites_it",),
        "a kept step loss is overwritten by the next replay",
    ),
    Mutation(
        "graph-dtypes-not-compared",
        "src/turbotrain/core/graphs.py",
        "        (tuple((tuple(t.shape), t.dtype, str(t.device)) for t in tensors_of(b)), float(w)) for b, w in micro",
        "        (tuple((tuple(t.shape), torch.float32, str(t.device)) for t in tensors_of(b)), float(w)) for b, w in micro",
        (f"{GRAPHS}::test_a_step_whose_dtypes_differ_from_the_captured_ones_is_refused_naming_both",),
        "a micro-batch of another dtype is copied into the captured buffers instead of refused",
    ),
    Mutation(
        "choose-keeps-the-fastest-step",
        "src/turbotrain/app/choose/rule.py",
        "    best = min(eligible, key=lambda r: r.projected_s or math.inf)",
        "    best = min(eligible, key=lambda r: r.step_ms or math.inf)  # mutation: the fastest step",
        (
            f"{CHOOSE}::test_of_the_candidates_that_pay_back_the_least_projected_run_time_is_kept_not_the_fastest_step",
        ),
        "choose keeps the fastest step, not the shortest projected run",
    ),
    Mutation(
        "cache-key-without-the-device",
        "src/turbotrain/core/meter/cache.py",
        '        "device": name,',
        '        "device": "",  # mutation: any device',
        (KEYS,),
        "choose's figures (and compile artefacts) from one GPU model are reused on another",
    ),
    Mutation(
        "warm-start-key-without-the-device",
        "src/turbotrain/app/warmstart.py",
        "        self.material: dict[str, Any] = cache.key_material(config, device) if self.active else {}",
        '        self.material: dict[str, Any] = cache.key_material(config, "cpu") if self.active else {}  # mutation',
        (KEYS,),
        "the compile warm start loads artefacts compiled on another GPU model",
    ),
    Mutation(
        "watch-stale-count-not-saved",
        "src/turbotrain/loop/early_stop.py",
        "        return dict(best=self.best, best_step=self.best_step, stale=self.stale, seen_step=self.seen_step)",
        "        return dict(best=self.best, best_step=self.best_step, stale=0, seen_step=self.seen_step)  # mutation",
        (f"{BEST}::test_a_resumed_run_stops_at_the_evaluation_the_uninterrupted_one_stops_at",),
        "a resumed run stops evaluations later than the uninterrupted one",
    ),
    Mutation(
        "nan-improves-on-the-first-pass",
        "src/turbotrain/loop/early_stop.py",
        "        if math.isnan(value):",
        "        if math.isnan(value) and self.best is not None:  # mutation",
        (f"{BEST}::test_nan_is_never_an_improvement_not_even_on_the_first_pass",),
        "a NaN first validation pass becomes the best",
    ),
    Mutation(
        "final-pass-not-watched",
        "src/turbotrain/loop/early_stop.py",
        "        self.watch.observe(ctx)  # a final pass (after a signal's stop) counts for the best",
        "        pass  # mutation: the final pass at a stop is not read",
        (FINAL_PASS,),
        "the final validation pass at a stop between evaluations never becomes the best",
    ),
    Mutation(
        "final-pass-not-kept",
        "src/turbotrain/loop/best_checkpoint.py",
        "        self._keep(ctx)  # a final validation pass that was the best",
        "        pass  # mutation: the best checkpoint ignores the final pass",
        (FINAL_PASS,),
        "the best checkpoint is not the final pass's, though it was the best",
    ),
    Mutation(
        "wandb-new-run-at-resume",
        "src/turbotrain/loop/monitor/trackers.py",
        '        ids = _read_ids(run_dir).get("wandb") or {"id": uuid.uuid4().hex[:12]}',
        '        ids = {"id": uuid.uuid4().hex[:12]}  # mutation: a new W&B run at every start',
        (TRACKERS,),
        "a resumed run starts another W&B run: its history split in two",
    ),
    Mutation(
        "mlflow-new-run-at-resume",
        "src/turbotrain/loop/monitor/trackers.py",
        '        if ids.get("uri") == uri and ids.get("run_id"):',
        "        if False:  # mutation: a new MLflow run at every start",
        (TRACKERS,),
        "a resumed run starts another MLflow run: its history split in two",
    ),
    Mutation(
        "lightning-loss-divided",
        "src/turbotrain/integrations/lightning.py",
        "        return loss * self._accumulation if loss is not None and self._accumulation > 1 else loss",
        "        return loss  # mutation: the loss Lightning hands callbacks, divided by accumulate_grad_batches",
        (
            "tests/integration/test_integrations.py::test_lightning_callback_trains_the_same_and_writes_the_run_directory",
        ),
        "the Lightning callback records training_step's loss divided by accumulate_grad_batches",
    ),
    Mutation(
        "hf-tail-steps-not-recorded",
        "src/turbotrain/integrations/hf.py",
        '        if last.get("step") != state.global_step:  # the steps after the last logging step',
        "        if False:  # mutation: the steps after the last logging step left out",
        (
            "tests/integration/test_integrations.py::test_hf_callback_records_the_steps_after_the_trainers_last_logging_step",
        ),
        "the steps after the Trainer's last logging step are missing from the records",
    ),
    Mutation(
        "fused-loss-mean-in-bf16",
        "src/turbotrain/parts/models/loss.py",
        "    return per_token.float().sum() / (targets != -100).sum()",
        "    return per_token.sum().float() / (targets != -100).sum()  # mutation: summed in bf16",
        ("tests/unit/test_loss_fused.py::test_under_bf16_autocast_the_mean_over_tokens_is_taken_in_fp32",),
        "model.loss=fused sums its per-token losses in bf16 under autocast",
    ),
    Mutation(
        "fp8-margin-4-percent",
        "src/turbotrain/core/precision/fp8_choice.py",
        "MARGIN = 0.05  # a float8 recipe must be at least 5 % faster than bf16: timing noise never flips a layer",
        "MARGIN = 0.04  # mutation",
        ("tests/unit/test_fp8_choice.py::test_the_margin_keeps_a_near_tie_in_bf16",),
        "a layer 4.5 % faster in float8 is converted (the margin is 5 %)",
    ),
    Mutation(
        "fp8-margin-6-percent",
        "src/turbotrain/core/precision/fp8_choice.py",
        "MARGIN = 0.05  # a float8 recipe must be at least 5 % faster than bf16: timing noise never flips a layer",
        "MARGIN = 0.06  # mutation",
        ("tests/unit/test_fp8_choice.py::test_the_margin_keeps_a_near_tie_in_bf16",),
        "a layer 5.5 % faster in float8 stays in bf16 (the margin is 5 %)",
    ),
    Mutation(
        "repeat-interleave-output-size-ignored",
        "src/turbotrain/app/profile/syncs.py",
        '        if name == "repeat_interleave" and kwargs.get("output_size") is None:',
        '        if name == "repeat_interleave":  # mutation: output_size not looked at',
        ("tests/unit/test_syncs.py::test_repeat_interleave_is_named_without_output_size_and_not_with_it",),
        "repeat_interleave with output_size (no sync) is named as a sync",
    ),
    Mutation(
        "run-probe-without-recompute",
        "src/turbotrain/loop/monitor/flops.py",
        "    args = (flops.source, devices, flop_tokens_per_sample(example_batch), flops.recompute, flops.convention)",
        "    args = (flops.source, devices, flop_tokens_per_sample(example_batch), 0.0, flops.convention)  # mutation",
        ("tests/unit/test_mfu_counts.py::test_recomputation_is_counted_apart_from_the_model_flops",),
        "a run with activation checkpointing records no HFU and no recomputation FLOPs",
    ),
    Mutation(
        "epochs-resume-ignores-accumulation",
        "src/turbotrain/app/resume.py",
        "    old, new = micro * accumulation * saved_world, c.batch.micro * c.batch.accumulation * world",
        "    old, new = micro * accumulation * saved_world, c.batch.micro * accumulation * world  # mutation",
        (
            "tests/unit/test_batching.py::test_an_epochs_run_resumed_at_another_global_batch_is_refused_whatever_the_accumulation",
        ),
        "an epochs run resumed at another accumulation is not refused: samples trained twice or skipped",
    ),
    Mutation(
        "static-rendezvous-ranks-decide-alone",
        "src/turbotrain/base/launch.py",
        '        return restarted if self.restart > 0 and (same_agent or not main) else ""',
        '        return restarted if self.restart > 0 and same_agent else ""  # mutation: every rank checks its agent',
        (
            "tests/unit/test_relaunch.py::test_under_the_static_rendezvous_the_other_ranks_follow_rank_0s_decision_to_resume",
        ),
        "under the static rendezvous another node's ranks start new while rank 0 resumes",
    ),
    Mutation(
        "modules-moved-inside-not-found",
        "src/turbotrain/__init__.py",
        "    if len(parts) == 3 and inside in MOVED_INSIDE:",
        "    if False:  # mutation: the old paths inside a layer folder forgotten",
        (
            "tests/unit/test_public_api.py::test_every_module_moved_inside_a_layer_imports_as_the_same_module_with_one_warning",
        ),
        "turbotrain.loop.sharded (an old path inside a layer) no longer imports",
    ),
    Mutation(
        "token-files-left-open",
        "src/turbotrain/app/training.py",
        "            training.data.close()  # its token files: a notebook's or a long session's runs leave none open",
        "            pass  # mutation: the token files left to the garbage collector",
        (
            "tests/integration/test_train_python.py::test_turbotrain_train_resolves_the_plan_and_the_spec_once",
        ),
        "a run leaves its token file open (a ResourceWarning later, a descriptor per run in a notebook)",
    ),
)
