"""An engine stepped the way the server consumes it: each step's token ids made into the requests' outputs
(text, stop strings, logprobs) by an OutputProcessor, and a request a stop string ended ended in the engine."""
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.outputs import OutputProcessor, RequestOutput, StepOutputs
from tsdev_runtime.engine.sequence import SamplingParams


class Consumer:
    def __init__(self, engine: LLMEngine):
        self.engine, self.processor = engine, OutputProcessor(engine.tokenizer)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params)
        self.processor.add(request_id, len(prompt), params)

    def step(self) -> list[RequestOutput]:
        return self.take(self.engine.step())

    def abort(self, request_id: str) -> RequestOutput | None:
        aborted = self.engine.abort(request_id)
        return self.take(aborted)[0] if aborted else None

    def recover(self) -> tuple[list[RequestOutput], dict[str, str]]:
        step, failed = self.engine.recover()
        return self.take(step), failed

    def take(self, step: StepOutputs) -> list[RequestOutput]:
        outputs, stopped = self.processor.process(step)
        for request_id in stopped:
            self.engine.abort(request_id, "stop")
        return outputs
