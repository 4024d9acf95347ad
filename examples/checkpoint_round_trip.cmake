# gpt2_train --save writes an llm.c checkpoint; --init of that file starts from the same weights
# (the first loss of a run from it equals the last evaluation's footing: it must not be ln V).
# The file holds whole tensors: it is saved from two tensor-parallel ranks and read by one rank
# and by two.
execute_process(COMMAND ${TRAIN} --demo --steps 30 --log-every 100 --save ${DIR}/demo.bin --tp 2 --threads 2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "training run failed (${rc}):\n${out}\n${err}")
endif()
execute_process(COMMAND ${TRAIN} --demo --init ${DIR}/demo.bin --steps 1 --warmup 0 --lr 0
                RESULT_VARIABLE rc OUTPUT_VARIABLE out2 ERROR_VARIABLE err2)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "run from the checkpoint failed (${rc}):\n${out2}\n${err2}")
endif()
string(REGEX MATCH "loss ([0-9.]+) -> " m "${out2}")
if(NOT CMAKE_MATCH_1 OR CMAKE_MATCH_1 GREATER 3.0)
  message(FATAL_ERROR "a run from the saved checkpoint should start trained (loss < 3), got '${CMAKE_MATCH_1}':\n${out2}")
endif()
message(STATUS "started from the checkpoint at loss ${CMAKE_MATCH_1}")
set(one_rank ${CMAKE_MATCH_1})
execute_process(COMMAND ${TRAIN} --demo --init ${DIR}/demo.bin --steps 1 --warmup 0 --lr 0 --tp 2 --threads 2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out4 ERROR_VARIABLE err4)
string(REGEX MATCH "loss ([0-9.]+) -> " m "${out4}")
if(NOT rc EQUAL 0 OR NOT CMAKE_MATCH_1 STREQUAL one_rank)
  message(FATAL_ERROR "two tensor-parallel ranks from the checkpoint should start at loss ${one_rank}, got (${rc}):\n${out4}\n${err4}")
endif()
file(WRITE ${DIR}/not_a_checkpoint.bin "hello")
execute_process(COMMAND ${TRAIN} --init ${DIR}/not_a_checkpoint.bin --steps 1
                RESULT_VARIABLE rc OUTPUT_VARIABLE out3 ERROR_VARIABLE err3)
if(rc EQUAL 0 OR NOT err3 MATCHES "loom: ")
  message(FATAL_ERROR "a bad checkpoint must be rejected with a loom error, got (${rc}):\n${out3}\n${err3}")
endif()
