"""The token rows of one generation call, on the host: what each row has emitted, when it stops, what the streamer has
been sent, and the per-cycle statistics of every row."""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..runtime import upload


def plain_stop_token_ids(stopping_criteria: StoppingCriteriaList) -> set[int] | None:
    """EOS ids when the criteria are only max-length and EOS (then a run is checked in one pass), else `None`."""
    stop_ids: set[int] = set()
    for criterion in stopping_criteria:
        if isinstance(criterion, EosTokenCriteria):
            stop_ids.update(int(t) for t in torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        elif not isinstance(criterion, MaxLengthCriteria):
            return None
    return stop_ids


class CallSequences:
    """Left-padded prompts `input_ids` (padding marked by `prompt_mask`) growing to at most `max_length` tokens, kept
    on the host (read from the device once, then from each cycle's read); rows stop by `stopping_criteria`; a
    `streamer` gets the steps as plain decoding sends them."""

    def __init__(
        self,
        input_ids: torch.LongTensor,
        prompt_mask: torch.Tensor,
        max_length: int,
        pad_token_id: int,
        stopping_criteria: StoppingCriteriaList,
        streamer=None,
    ) -> None:
        batch, prompt_len = input_ids.shape
        self.batch, self.prompt_len, self.max_length, self.pad_token_id = batch, prompt_len, max_length, pad_token_id
        self.device = input_ids.device
        prompts = torch.cat([input_ids.long(), prompt_mask.long()], dim=1).tolist()  # the call's first read
        self.tokens: list[list[int]] = [row[:prompt_len] for row in prompts]
        self.padding = [prompt_len - sum(row[prompt_len:]) for row in prompts]  # prompt padding of each row
        self.finished = [False] * batch
        self.stopping_criteria = stopping_criteria
        self.stop_token_ids = plain_stop_token_ids(stopping_criteria)
        self.judged = prompt_len  # general criteria have judged the columns before this one
        self.streamer = streamer
        self.streamed = prompt_len  # steps sent to the streamer end at this column
        self.accepted_lengths: list[list[int]] = [[] for _ in range(batch)]
        self.block_sizes: list[list[int]] = [[] for _ in range(batch)]
        self.verify_widths: list[list[int]] = [[] for _ in range(batch)]
        self.lookup_wins = [0] * batch

    def sequence(self, row: int) -> torch.LongTensor:
        """The ids of `row` so far (prompt padding included), on the device."""
        return upload(self.tokens[row], self.device)

    def text(self, row: int) -> list[int]:
        """The tokens of `row` so far, prompt padding left out."""
        return self.tokens[row][self.padding[row] :]

    def remaining(self, rows: list[int]) -> int:
        """Most tokens any of `rows` may still generate."""
        return max(self.max_length - len(self.tokens[row]) for row in rows)

    def emit(self, row: int, tokens: list[int]) -> int:
        """Append `tokens` to `row` (cut at the length limit, and with only EOS / max-length criteria at the first
        EOS); returns how many were appended. Other criteria judge the rows later, column by column
        ([`judge_columns`])."""
        sequence = self.tokens[row]
        tokens = tokens[: self.max_length - len(sequence)]
        stop = None
        if self.stop_token_ids is not None:  # only max-length / EOS criteria: each row is judged alone, at once
            stop = next((i for i, token in enumerate(tokens) if token in self.stop_token_ids), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
        sequence.extend(tokens)
        self.finished[row] = stop is not None or len(sequence) >= self.max_length
        return len(tokens)

    def record(self, row: int, emitted: int, block: int, width: int, lookup_won: bool) -> None:
        """One cycle's statistics of `row`: tokens emitted, its block size and verify width, whether a lookup path
        was kept."""
        self.accepted_lengths[row].append(emitted)
        self.block_sizes[row].append(block)
        self.verify_widths[row].append(width)
        self.lookup_wins[row] += int(lookup_won)

    def columns(self, width: int) -> list[list[int]]:
        """The rows' first `width` tokens, rows that stopped padded."""
        return [(row + [self.pad_token_id] * width)[:width] for row in self.tokens]

    def judge_columns(self) -> None:
        """Call general stopping criteria as plain `generate` does: once per generated column, on the whole batch
        (rows that stopped padded, on the device), for every column all running rows have reached. A row found
        stopped at a column loses the tokens it drafted past it (its statistics too)."""
        if self.stop_token_ids is not None:
            return
        while True:
            lengths = [len(row) for row in self.tokens]
            running = [length for length, done in zip(lengths, self.finished) if not done]
            reached = min(running) if running else max(lengths)
            if self.judged >= reached:
                return
            column = self.judged
            stops = self.stopping_criteria(upload(self.columns(column + 1), self.device), None).tolist()
            for row in range(self.batch):  # rows that stopped at the length limit are judged up to it too
                if lengths[row] > column and stops[row]:
                    self._truncate(row, column + 1)
            self.judged += 1

    def _truncate(self, row: int, length: int) -> None:
        """End `row` at `length` tokens: later tokens leave it and its per-cycle statistics."""
        extra = len(self.tokens[row]) - length
        del self.tokens[row][length:]
        self.finished[row] = True
        while extra > 0 and self.accepted_lengths[row]:
            last = self.accepted_lengths[row][-1]
            if last > extra:
                self.accepted_lengths[row][-1] = last - extra
                break
            extra -= last
            for statistic in (self.accepted_lengths, self.block_sizes, self.verify_widths):
                statistic[row].pop()

    def stream(self) -> None:
        """Send the streamer the steps every row has reached, as plain decoding sends them: one `(batch,)` tensor
        of token ids per step (on the host), the pad token in rows that have stopped."""
        if self.streamer is None:
            return
        lengths = [len(row) for row in self.tokens]
        running = [length for length, done in zip(lengths, self.finished) if not done]
        reached = min(running) if running else max(lengths)
        steps = self.columns(reached)
        for column in range(self.streamed, reached):
            self.streamer.put(torch.tensor([row[column] for row in steps]))
        self.streamed = max(self.streamed, reached)

    def end_stream(self) -> None:
        """Tell the streamer that generation has ended."""
        if self.streamer is not None:
            self.streamer.end()

    def output(self) -> torch.LongTensor:
        """The sequences on the device, finished rows right-padded."""
        return upload(self.columns(max(len(row) for row in self.tokens)), self.device)
