"""Progress in cluster logs: a steady line when stderr is not a terminal."""
import io

from batchgen.pipeline.run.progress import Progress, ProgressReport


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_line_at_a_steady_interval_with_jobs_rate_and_eta():
    clock, stream = Clock(), io.StringIO()
    report = ProgressReport(every=30, stream=stream, clock=clock)
    p = Progress(jobs_done=100, jobs_total=1000, resumed=100, completion_tokens=0, prompt_tokens=0,
                 cached_tokens=0, elapsed=0.0)
    for second in range(1, 91):  # one job a second, 20 new tokens each
        clock.now = float(second)
        p.jobs_done, p.completion_tokens, p.elapsed = 100 + second, 20 * second, float(second)
        p.prompt_tokens, p.cached_tokens = 50 * second, 40 * second
        report.update(p)
    lines = stream.getvalue().splitlines()
    assert lines == [
        "batchgen: 130/1000 jobs (13.0%), 20.0 tokens/s, cache reuse 80%, ETA 0:14:30",
        "batchgen: 160/1000 jobs (16.0%), 20.0 tokens/s, cache reuse 80%, ETA 0:14:00",
        "batchgen: 190/1000 jobs (19.0%), 20.0 tokens/s, cache reuse 80%, ETA 0:13:30",
    ]
    report.close()  # nothing new since the last line
    assert len(stream.getvalue().splitlines()) == 3
    p.jobs_done += 1  # the reporter keeps its own copy: a caller reusing its object is fine
    report.update(p)
    report.close()
    assert stream.getvalue().splitlines()[-1].startswith("batchgen: 191/1000 jobs")


def test_the_last_state_is_printed_at_close_and_eta_is_unknown_before_a_job():
    clock, stream = Clock(), io.StringIO()
    report = ProgressReport(every=30, stream=stream, clock=clock)
    report.update(Progress(5, 10, 5, 0, 0, 0, 1.0))
    report.close()
    assert stream.getvalue() == "batchgen: 5/10 jobs (50.0%), 0.0 tokens/s, cache reuse 0%, ETA unknown\n"
