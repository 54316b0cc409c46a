// How shmps-train stops on SIGINT (Ctrl-C), SIGTERM, SIGHUP and SIGPIPE
// (its stdout's reader exited, as `| head` does): the parent
// notes the signal, ends the job through its cleanup (workers killed, its
// server stopped, temp files and buffer objects removed), then dies of the
// signal itself, so that a shell sees a process killed by it (bash ends a
// loop on a child killed by SIGINT, not on one that exited 130). A signal
// the job was started with ignored (nohup, `cmd &` without job control)
// stays ignored, in the parent and in the workers. A second signal takes
// its default action at once (but SIGPIPE, raised by every write to the
// closed pipe).
#pragma once

namespace shmps::train {

// The parent, before it starts anything: catches each of the four
// signals that is not ignored.
void catch_stop_signals();
// A forked worker: the dispositions the parent had before it caught them.
void restore_stop_signals();
// The signal caught, or 0.
int stop_signal();
// After the cleanup: dies of the signal caught (returns when none was).
void die_of_stop_signal();

}  // namespace shmps::train
