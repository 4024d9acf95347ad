# --save-state and --resume of a series (a name holding {step}) with --keep-last: a run keeps one
# file per save and only the newest few (the periodic ones written in the background,
# --async-save); resumed from the series on another mesh, it goes on from the newest intact file
# (passing over a damaged one) and ends where the uninterrupted run ends (DESIGN.md invariant 3);
# --check-state tells the intact files from the damaged one.
# A run that would mix its files with another run's, a series with nothing to resume from, and a
# malformed pattern are refused before step 1. TRAIN is gpt2_train or bert_train, DIR a scratch
# directory.
set(common --demo --steps 12 --warmup 2 --log-every 100)
include(${CMAKE_CURRENT_LIST_DIR}/train_script.cmake)
# A run that must be refused before step 1 with a message matching `expected`.
function(refused expected)
  execute_process(COMMAND ${TRAIN} ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "${expected}" OR out MATCHES "step +1 \\|")
    message(FATAL_ERROR "${TRAIN} ${ARGN} should be refused before step 1 with \"${expected}\", got (${rc}):\n${out}\n${err}")
  endif()
endfunction()
# Fails unless the file names in `dir`, sorted and joined by spaces, are `expected`.
function(expect_names dir expected when)
  file(GLOB paths RELATIVE ${dir} ${dir}/*)
  list(SORT paths)
  string(JOIN " " names ${paths})
  if(NOT names STREQUAL expected)
    message(FATAL_ERROR "${when} ${dir} should hold ${expected}, got: ${names}")
  endif()
endfunction()

file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR}/series)
set(pattern ${DIR}/series/step{step}.state)
# Not the series' own: never listed, never deleted.
file(WRITE ${DIR}/series/notes.txt "kept")
file(WRITE ${DIR}/series/step3.state "kept")

train(whole)

# Saves after steps 2, 4, 6 (in the background: --async-save) and (the end, waiting) 7; each save
# in place deletes all but the newest two.
train(first --stop-after 7 --save-every 2 --async-save --keep-last 2 --save-state ${pattern} --dp 2 --threads 2)
if(NOT first MATCHES "saved training state [^\n]*/step00000006\\.state after step 6"
   OR NOT first MATCHES "saving training state [^\n]*/step00000004\\.state after step 4 in the background"
   OR NOT first MATCHES "saved training state [^\n]*/step00000007\\.state after step 7"
   OR NOT first MATCHES "removed [^\n]*/step00000004\\.state \\(--keep-last 2\\)")
  message(FATAL_ERROR "the first run should save each step's file and remove the older ones:\n${first}")
endif()
expect_names(${DIR}/series "notes.txt step00000006.state step00000007.state step3.state" "after the first run")

# A fresh run writing into the series would mix its files with the first's.
refused("loom: --save-state [^\n]*step\\{step\\}\\.state: got a file saved after step 7, [^\n]*step00000007\\.state; this run starts at step 1"
        --save-state ${pattern})
# Nor may a run resumed from an earlier file save into it: a --resume of the series would skip it.
refused("got a file saved after step 7, [^\n]*; this run starts after step 6"
        --resume ${DIR}/series/step00000006.state --save-state ${pattern})

train(second --resume ${pattern} --save-state ${pattern} --save-every 2 --keep-last 2 --pp 2 --threads 2)
if(NOT second MATCHES "resumed from [^\n]*/step00000007\\.state after step 7"
   OR NOT second MATCHES "over steps 8\\.\\.12 of 12")
  message(FATAL_ERROR "the second run should go on from the series' newest file, after step 7:\n${second}")
endif()
expect_resumed_loss("${whole}" "${second}" "stopped on dp2 after step 7 and resumed from the series on pp2")
expect_names(${DIR}/series "notes.txt step00000010.state step00000012.state step3.state" "after the second run")

# The newest file damaged (here overwritten, as a disk or a copy might leave it): the resume passes
# it over for step 10's, moves it out of the series, and the run ends where the whole run ends.
file(WRITE ${DIR}/series/step00000012.state "not a checkpoint any more: the bytes of a damaged file")
train(third --resume ${pattern} --save-state ${pattern} --save-every 2 --keep-last 2 --tp 2 --threads 2)
if(NOT third MATCHES "passed over step 12, which is corrupt \\(loom: [^\n]*step00000012\\.state': magic: got [^\n]*\\); moved it to [^\n]*/step00000012\\.state\\.corrupt\n"
   OR NOT third MATCHES "resumed from [^\n]*/step00000010\\.state after step 10")
  message(FATAL_ERROR "the third run should pass over the damaged step 12 and go on from step 10:\n${third}")
endif()
expect_resumed_loss("${whole}" "${third}" "resumed on tp2 from step 10, past a damaged step 12")
expect_names(${DIR}/series "notes.txt step00000010.state step00000012.state step00000012.state.corrupt step3.state"
             "after the third run")

# --check-state reads files whole without training: the series' two are intact, the damaged one
# moved aside is not (exit 1), and the flag is a mode of its own (--demo beside it is refused).
execute_process(COMMAND ${TRAIN} --check-state ${pattern} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "step00000010\\.state: intact: saved after step 10, AdamW \\(2 state slots\\), fp32"
   OR NOT out MATCHES "2 of 2 files intact")
  message(FATAL_ERROR "--check-state of the series should find its two files intact (${rc}):\n${out}\n${err}")
endif()
execute_process(COMMAND ${TRAIN} --check-state ${DIR}/series/step00000012.state.corrupt
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1 OR NOT out MATCHES "step00000012\\.state\\.corrupt: CORRUPT: loom: [^\n]*magic")
  message(FATAL_ERROR "--check-state of the damaged file should say so and exit 1 (${rc}):\n${out}\n${err}")
endif()
refused("loom: --check-state: got [^\n]*; it checks files and trains nothing, so --demo would change nothing"
        --check-state ${pattern})

# A series with no file yet: refused, or (--resume-if-exists) a run from step 1.
file(MAKE_DIRECTORY ${DIR}/empty)
refused("loom: --resume: got [^\n]*/empty/s\\{step\\}; no file of the series is in [^\n]*/empty \\(--resume-if-exists"
        --resume ${DIR}/empty/s{step})
train(fresh --stop-after 2 --resume ${DIR}/empty/s{step} --resume-if-exists --save-state ${DIR}/empty/s{step})
if(NOT fresh MATCHES "no file of the series yet; starting at step 1" OR NOT EXISTS ${DIR}/empty/s00000002)
  message(FATAL_ERROR "--resume-if-exists on an empty series should start at step 1 and save:\n${fresh}")
endif()
# A pattern must hold {step} once, in the file's name.
refused("loom: --save-state: got [^\n]*; \\{step\\} must be in the file's name, not in a directory"
        --save-state ${DIR}/{step}/run.state)
refused("loom: --resume: got [^\n]*; \\{step\\} must appear once" --resume ${DIR}/a{step}b{step})
